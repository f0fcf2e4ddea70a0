"""Unshuffled token budgets fill their batches as a greedy in-order cut does (issue 32, item 5).

``shuffle=False`` with ``max_tokens`` counted every sample at the capacity of the longest lengths,
then split the real batches to that count: 1,003 documents at max_tokens=65536 gave 1,003
one-sample batches on one rank, where a greedy cut in order gives a few hundred. One data group
(one node, any number of ranks) now plans exactly the greedy cut; several groups plan an estimate
from the summaries, taken a little long so that nothing is left out."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.realtext import issue32_lengths, stdlib_lengths
from helpers.strategies import datasets
from shardtool.plan import ArraySource, Batching, DataLayout, Layout, Planner
from shardtool.plan.batching import in_order_starts
from shardtool.plan.simulate import simulate_epoch
from shardtool.plan.synthetic import lognormal_lengths

BUDGET = 65536


def _greedy(lengths: np.ndarray, budget: int) -> int:
    return int(in_order_starts(lengths, Batching(max_tokens=budget, shuffle=False)).size) if lengths.size else 0


def _shards(size: int, per: int | None) -> list[int]:
    per = per or size
    return [per] * (size // per) + ([size % per] if size % per else [])


def _batches(source: ArraySource, layout: DataLayout, batching: Batching) -> list[list[np.ndarray]]:
    planner = Planner(source, batching)
    state = planner.start(0, "v", layout)
    return [planner.rank_plan(state, d).batches() for d in range(layout.dp_size)]


def _check_budget(batches: list[list[np.ndarray]], lengths: np.ndarray, budget: int) -> None:
    for rank in batches:
        for b in rank:
            assert b.size >= 1 and b.size * int(np.maximum(lengths[b], 1).max()) <= budget


def _issue_shape() -> np.ndarray:
    lengths = issue32_lengths()
    return lengths[lengths <= BUDGET]  # a few stdlib files are longer than the budget


@pytest.mark.parametrize("ranks", [1, 3, 8])
@pytest.mark.parametrize("per_shard", [None, 100])
def test_one_node_plans_the_greedy_cut_of_the_issue_shape(ranks, per_shard):
    lengths = _issue_shape()
    source = ArraySource(lengths, _shards(lengths.size, per_shard))
    layout = DataLayout.pure_dp(Layout(1, ranks))
    batching = Batching(max_tokens=BUDGET, shuffle=False)
    greedy = _greedy(lengths, BUDGET)
    batches = _batches(source, layout, batching)
    total = sum(len(r) for r in batches)
    assert len({len(r) for r in batches}) == 1  # equal counts
    # The greedy cut, split to a multiple of the ranks (drop_last: a surplus of under one per rank).
    assert abs(total - greedy) <= ranks - 1, (total, greedy)
    _check_budget(batches, lengths, BUDGET)
    served = np.sort(np.concatenate([b for r in batches for b in r]))
    if ranks == 1 or total >= greedy:
        assert np.array_equal(served, np.arange(lengths.size))  # nothing left out


@pytest.mark.parametrize("layout", [Layout(2, 2), Layout(4, 1), Layout(2, 4)])
@pytest.mark.parametrize("corpus", ["issue32", "stdlib", "lognormal"])
def test_several_nodes_fill_their_batches_nearly_as_the_greedy_cut_and_drop_nothing(corpus, layout):
    if corpus == "lognormal":  # the quickstart's shape: tokens of a lognormal length, 1,500 a shard
        lengths, per, budget = lognormal_lengths(20_000, seed=3), 1500, 8192
    else:
        lengths = _issue_shape() if corpus == "issue32" else stdlib_lengths()
        lengths, per, budget = lengths[lengths <= BUDGET], 100, BUDGET
    source = ArraySource(lengths, _shards(lengths.size, per))
    data = DataLayout.pure_dp(layout)
    sim = simulate_epoch(source, data, Batching(max_tokens=budget, shuffle=False, drop_last=False))
    cuts = sim.shape.cuts
    greedy = sum(_greedy(lengths[cuts[g] : cuts[g + 1]], budget) for g in range(data.num_groups))
    total = sim.shape.batches_per_rank * data.dp_size
    assert sim.remainder_tokens == 0
    # Each group's count is estimated a little long (IN_ORDER_MARGIN, 5%) and equalised up.
    assert greedy <= total <= 1.2 * greedy + data.dp_size, (total, greedy)


@settings(max_examples=40, deadline=None)
@given(data=datasets(min_size=50, max_size=3000), ranks=st.integers(1, 8), budget=st.sampled_from([2000, 8192, 65536]))
def test_one_group_is_the_greedy_cut_for_any_lengths_and_ranks(data, ranks, budget):
    source = ArraySource(data.lengths, data.shard_counts)
    layout = DataLayout.pure_dp(Layout(1, ranks))
    greedy = _greedy(data.lengths, budget)
    for drop_last in (False, True):
        batching = Batching(max_tokens=budget, shuffle=False, drop_last=drop_last)
        try:
            batches = _batches(source, layout, batching)
        except ValueError as e:  # fewer samples than ranks: refused with a message
            assert "too small" in str(e) and data.lengths.size < ranks
            return
        total = sum(len(r) for r in batches)
        if drop_last:
            assert greedy - (ranks - 1) <= total <= greedy + ranks - 1
        else:
            assert greedy <= total <= greedy + ranks - 1
            assert sum(b.size for r in batches for b in r) == data.lengths.size
        _check_budget(batches, data.lengths, budget)


def test_a_planner_pickles_and_plans_the_same_after():
    """A planner travels to spawned processes (a loader under ``multiprocessing`` spawn); the source
    wrapper that keeps its last lengths read must survive the round trip."""
    import pickle

    lengths = _issue_shape()
    batching = Batching(max_tokens=BUDGET, shuffle=False)
    planner = Planner(ArraySource(lengths, _shards(lengths.size, 100)), batching)
    layout = DataLayout.pure_dp(Layout(1, 2))
    before = planner.rank_plan(planner.start(0, "v", layout), 1).batches()
    copy = pickle.loads(pickle.dumps(planner))
    after = copy.rank_plan(copy.start(0, "v", layout), 1).batches()
    assert len(after) == len(before) and all(np.array_equal(a, b) for a, b in zip(after, before))
