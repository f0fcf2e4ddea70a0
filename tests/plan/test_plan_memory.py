"""A training rank's planning memory grows with its data group's share, not with the dataset.

Rank R of 1,024 nodes x 8 ranks plans a synthetic 10^8-sample dataset (10^4 shards). Its
summaries are computed here, in the parent, as `pack` would have stored them; a fresh child
process reads them and plans, under tracemalloc (numpy reports its allocations to it), exactly
what the loader does at start-up (Planner.start + rank_plan) and after losing a node (an elastic
resume onto 1,023 nodes). A per-sample array of the whole dataset would be 800 MB; one group's
share is about 10^5 samples (0.8 MB as int64).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shardtool.plan.synthetic import SyntheticSource

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N = 100_000_000
PER_SHARD = 10_000
NODES, RPN = 1024, 8
RANK = 4100

CHILD = r"""
import json, sys, time, tracemalloc
from shardtool.format.summaries import ShardSummaries
from shardtool.plan import Batching, DataLayout, Layout, Planner
from shardtool.plan.synthetic import SyntheticSource

path, n, per_shard, nodes, rpn, rank = sys.argv[1], *map(int, sys.argv[2:])
source = SyntheticSource(n, samples_per_shard=per_shard, seed=0)
with open(path, "rb") as f:
    data = f.read()
source.use_summaries(ShardSummaries.from_bytes(data, lengths_hash=None, counts=source.shard_counts,
                                               total_tokens=None, source=path))
source.shard_lengths(0)  # the quantile table of the lengths generator: made once per process
layout = DataLayout.pure_dp(Layout(nodes, rpn))
batching = Batching(max_tokens=65536, seed=1)
out = {"summaries_bytes": len(data), "group_samples": n // layout.num_groups}

tracemalloc.start()
began = time.perf_counter()
planner = Planner(source, batching)
state = planner.start(0, "synthetic", layout)
plan = planner.rank_plan(state, rank)
out["start_seconds"] = time.perf_counter() - began
out["start_peak"] = tracemalloc.get_traced_memory()[1]
out["rank_samples"] = int(plan.ids.size)
out["batches"] = plan.batches_per_rank
del planner, state, plan

# A node lost at half the epoch: the job resumes on nodes - 1; rank `rank` plans its re-dealt share.
tracemalloc.reset_peak()
began = time.perf_counter()
planner = Planner(source, batching)
state = planner.start(0, "synthetic", layout).with_served(planner.shape(layout).batches_per_rank // 2)
smaller = DataLayout.pure_dp(Layout(nodes - 1, rpn))
resumed = planner.continue_on(state, smaller)
plan = planner.rank_plan(resumed, rank)
out["resume_seconds"] = time.perf_counter() - began
out["resume_peak"] = tracemalloc.get_traced_memory()[1]
out["resume_samples"] = int(plan.ids.size)

# The instrument: numpy's allocations are traced (else every peak above would be vacuous).
import numpy as np
tracemalloc.reset_peak()
probe = np.ones(2_000_000, dtype=np.int64)
out["probe_peak"] = tracemalloc.get_traced_memory()[1]
print(json.dumps(out))
"""


@pytest.mark.timeout(300)
def test_planning_rank_r_of_1e8_samples_on_1024x8_stays_within_its_share(tmp_path):
    source = SyntheticSource(N, samples_per_shard=PER_SHARD, processes=2)
    path = tmp_path / "summaries.arrow"
    path.write_bytes(source.summaries.to_bytes("synthetic"))
    res = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), str(N), str(PER_SHARD), str(NODES), str(RPN), str(RANK)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout)
    share = got["group_samples"] * 8  # the group's share as one int64 per sample
    bound = 40 * share + 3 * got["summaries_bytes"]
    print(
        f"\n1e8 samples on {NODES}x{RPN}, rank {RANK}: group share {got['group_samples']:,} samples "
        f"({share / 1e6:.2f} MB as int64), summaries {got['summaries_bytes'] / 1e6:.2f} MB, bound "
        f"{bound / 1e6:.1f} MB; peak traced at start-up {got['start_peak'] / 1e6:.1f} MB "
        f"({got['start_seconds']:.2f} s), at an elastic resume {got['resume_peak'] / 1e6:.1f} MB "
        f"({got['resume_seconds']:.2f} s); a whole-dataset int64 array: {N * 8 / 1e6:.0f} MB"
    )
    per_rank = got["group_samples"] / RPN
    assert got["batches"] > 0 and 0.9 * per_rank < got["rank_samples"] <= 1.1 * per_rank
    assert got["resume_samples"] > 0
    assert got["probe_peak"] >= 16_000_000, "tracemalloc sees numpy's arrays"
    assert got["start_peak"] < bound, got
    assert got["resume_peak"] < bound, got
