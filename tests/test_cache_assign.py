"""Node assignment through the planner's pure function (node placement is tested in test_env.py)."""
import numpy as np
from hypothesis import given, settings, strategies as st

from shardtool.cache.assign import assigned_shards
from shardtool.plan import Layout, Placement, node_shard_ranges, shards_for_node


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
    per_node = [assigned_shards(lengths, counts, Placement(Layout(nodes, ranks_per_node), k)) for k in range(nodes)]
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
