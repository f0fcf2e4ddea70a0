"""The in-order greedy cut's batch count estimated from the summaries (`plan.inorder`), against the
cut itself, on real text lengths and lognormal ones, in random and sorted orders. `plan_shape` uses
it for several data groups, 5% long (an under-estimate would leave samples out)."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.realtext import stdlib_lengths
from shardtool.format.sketch import sketch_cells
from shardtool.format.summaries import ShardSummaries
from shardtool.plan import Batching
from shardtool.plan.batching import in_order_starts
from shardtool.plan.inorder import inorder_batches
from shardtool.plan.synthetic import lognormal_lengths


def _greedy(lengths: np.ndarray, budget: int) -> int:
    return int(in_order_starts(lengths, Batching(max_tokens=budget, shuffle=False)).size)


def _orders(lengths: np.ndarray):
    rng = np.random.default_rng(1)
    return {"random": rng.permutation(lengths), "ascending": np.sort(lengths), "descending": np.sort(lengths)[::-1]}


@pytest.mark.parametrize("order", ["random", "ascending", "descending"])
@pytest.mark.parametrize(
    "name, budget, shard",
    [("stdlib", 65536, 100), ("lognormal", 8192, 1500), ("lognormal", 8192, 50)],
)
def test_estimate_is_near_the_greedy_cut(name, budget, shard, order):
    lengths = stdlib_lengths() if name == "stdlib" else lognormal_lengths(20_000, seed=1)
    lengths = lengths[lengths <= budget][:1003] if name == "stdlib" else lengths
    ordered = _orders(lengths)[order]
    counts = np.full(-(-ordered.size // shard), shard)
    counts[-1] = ordered.size - shard * (counts.size - 1)
    summaries = ShardSummaries.from_lengths(ordered, counts, sketch_cells(counts.size))
    got = float(inorder_batches(summaries, np.array([0, ordered.size]), budget)[0])
    want = _greedy(ordered, budget)
    assert abs(got / want - 1) <= 0.04, (got, want)
