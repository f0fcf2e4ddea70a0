"""Node assignment through the planner's pure function (node placement is tested in test_env.py)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardtool.cache.assign import assigned_shards
from shardtool.format.summaries import ShardSummaries
from shardtool.plan import DataLayout, Layout, Placement, group_cuts, group_shard_pieces, parse_mesh, shards_for_node
from shardtool.plan.mesh import data_layout


@st.composite
def datasets(draw):
    counts = draw(st.lists(st.integers(0, 30), min_size=1, max_size=40))
    total = sum(counts)
    lengths = draw(st.lists(st.integers(0, 5000), min_size=total, max_size=total))
    return ShardSummaries.from_lengths(np.array(lengths, dtype=np.int64), np.array(counts, dtype=np.int64))


@settings(max_examples=60, deadline=None)
@given(datasets(), st.integers(1, 70), st.integers(1, 8))
def test_union_covers_every_sample_and_nodes_overlap_only_at_boundaries(summaries, nodes, ranks_per_node):
    layout = Layout(nodes, ranks_per_node)
    per_node = [assigned_shards(summaries, Placement(layout, k)) for k in range(nodes)]
    pure = DataLayout.pure_dp(layout)
    assert per_node == [shards_for_node(summaries, pure, k) for k in range(nodes)]  # one seam, same function
    union = set().union(*map(set, per_node))
    assert union == {i for i, c in enumerate(summaries.samples.tolist()) if c > 0}
    seen = np.zeros(int(summaries.samples.sum()), dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(summaries.samples)])
    for pieces in group_shard_pieces(summaries, group_cuts(summaries, pure.group_sizes)):
        for shard, a, b in pieces:
            seen[offsets[shard] + a : offsets[shard] + b] += 1
    assert (seen == 1).all()
    assert sum(len(p) for p in per_node) <= len(union) + nodes - 1
    for p in per_node:
        assert p == sorted(p)


def test_all_means_every_shard():
    summaries = ShardSummaries.from_lengths(np.ones(3, np.int64), np.array([1, 0, 2]))
    assert assigned_shards(summaries, None) == [0, 1, 2]


def test_pipeline_stages_across_nodes_warm_the_same_range_on_every_node_of_the_group():
    # 4 nodes x 2 ranks, mesh pp=2, dp=2, tp=2: DP rank 0 lives on nodes 0 and 2, DP rank 1 on 1 and 3.
    summaries = ShardSummaries.from_lengths(np.full(400, 10, np.int64), np.full(8, 50))
    layout = Layout(4, 2)
    data, _ = data_layout(parse_mesh("pp=2,dp=2,tp=2"), ("dp",), layout)
    per_node = [assigned_shards(summaries, Placement(layout, k), data) for k in range(4)]
    assert per_node[0] == per_node[2] == [0, 1, 2, 3] and per_node[1] == per_node[3] == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="beyond"):
        assigned_shards(summaries, Placement(Layout(2, 2), 0), data)
