"""Node assignment through the planner's pure function, and node layout resolution."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from cache.assign import NodeLayout, assigned_shards, resolve_node_layout
from cache.errors import UsageError
from loader.plan import node_shard_ranges, shards_for_node


@st.composite
def datasets(draw):
    counts = draw(st.lists(st.integers(0, 30), min_size=1, max_size=40))
    total = sum(counts)
    lengths = draw(st.lists(st.integers(0, 5000), min_size=total, max_size=total))
    return np.array(lengths, dtype=np.int64), np.array(counts, dtype=np.int64)


@settings(max_examples=60, deadline=None)
@given(datasets(), st.integers(1, 70), st.integers(1, 8))
def test_union_covers_every_sample_and_nodes_overlap_only_at_boundaries(ds, nodes, ranks_per_node):
    lengths, counts = ds
    per_node = [assigned_shards(lengths, counts, NodeLayout(k, nodes, ranks_per_node)) for k in range(nodes)]
    assert per_node == [shards_for_node(lengths, counts, k, nodes) for k in range(nodes)]  # one seam, same function
    union = set().union(*map(set, per_node))
    assert union == {i for i, c in enumerate(counts) if c > 0}
    # Sample ranges are disjoint and cover: a shard is shared only where a node boundary splits it.
    seen = np.zeros(int(counts.sum()), dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    for pieces in node_shard_ranges(lengths, counts, nodes):
        for shard, a, b in pieces:
            seen[offsets[shard] + a : offsets[shard] + b] += 1
    assert (seen == 1).all()
    assert sum(len(p) for p in per_node) <= len(union) + nodes - 1
    for p in per_node:
        assert p == sorted(p)


def test_all_means_every_shard():
    assert assigned_shards(np.ones(3, np.int64), np.array([1, 0, 2]), None) == [0, 1, 2]


def test_layout_from_slurm_and_precedence():
    env = {"SLURM_JOB_NUM_NODES": "4", "SLURM_NODEID": "2", "SLURM_NTASKS_PER_NODE": "8(x4)"}
    assert resolve_node_layout(env=env) == NodeLayout(2, 4, 8)
    assert resolve_node_layout(nodes=2, node_rank=1, env=env) == NodeLayout(1, 2, 8)
    assert resolve_node_layout(env={"SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_GPUS_ON_NODE": "4"}) == NodeLayout(1, 2, 4)
    assert resolve_node_layout(env={}) == NodeLayout(0, 1, None)


@pytest.mark.parametrize("kw,env", [
    ({"nodes": 4}, {}),                       # several nodes, no rank (a prolog has no SLURM_NODEID)
    ({"nodes": 2, "node_rank": 2}, {}),
    ({"node_rank": 1}, {}),
    ({}, {"SLURM_JOB_NUM_NODES": "x"}),
])
def test_layout_errors_are_usage_errors(kw, env):
    with pytest.raises(UsageError):
        resolve_node_layout(env=env, **kw)
