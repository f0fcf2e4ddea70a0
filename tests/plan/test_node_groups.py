"""Nodes that read one range together (`nodes_per_group`): the data groups of each block of K
consecutive nodes join, with pure data parallelism and under a mesh, and every node of a group
is assigned the group's whole range (what its cache must hold)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardtool.plan import (
    ArraySource,
    DataLayout,
    Layout,
    LayoutError,
    Placement,
    data_parallel,
    group_cuts,
    parse_mesh,
    shards_for_node,
)
from shardtool.plan.layout import node_blocks


@settings(max_examples=60, deadline=None)
@given(nodes=st.integers(1, 9), per_node=st.integers(1, 4), k=st.integers(1, 12))
def test_groups_are_blocks_of_k_consecutive_nodes_and_every_node_caches_its_groups_range(nodes, per_node, k):
    layout = Layout(nodes, per_node)
    data = DataLayout.pure_dp(layout, k)
    blocks = node_blocks(nodes, k)
    assert data.group_nodes == blocks and [n for b in blocks for n in b] == list(range(nodes))
    assert all(len(b) == min(k, nodes) for b in blocks[:-1]) and 1 <= len(blocks[-1]) <= min(k, nodes)
    assert data.group_sizes == tuple(per_node * len(b) for b in blocks) and sum(data.group_sizes) == layout.world_size
    if k == 1:
        assert data == DataLayout.pure_dp(layout)
    # Every DP rank sits in the group of its own node's block.
    for rank in range(layout.world_size):
        group, _ = data.group_of(rank)
        assert layout.node_of(rank) in blocks[group]
    lengths = np.random.default_rng(nodes * 100 + per_node).integers(1, 500, 400)
    source = ArraySource(lengths, [40] * 10)
    cuts = group_cuts(source.summaries, data.group_sizes)
    assert cuts[0] == 0 and cuts[-1] == 400 and np.all(np.diff(cuts) >= 0)
    for block in blocks:  # the nodes of a block hold the same shards: their group's range
        held = [shards_for_node(source.summaries, data, n) for n in block]
        assert all(h == held[0] for h in held)
    # Given through `data_parallel`, as the loader, `shardtool plan` and `shardtool warm` take it.
    assert data_parallel(Placement(layout, 0, 0), nodes_per_group=k) == (data, 0)


def test_under_a_mesh_replicas_groups_join_by_block_too():
    # dp=4 x tp=2 on 4 nodes of 2: one DP rank a node; two nodes a group: 2 groups of 2 DP ranks.
    placement = Placement(Layout(4, 2), 3, 7)
    data, dp_rank = data_parallel(placement, mesh=parse_mesh("dp=4,tp=2"), nodes_per_group=2)
    assert data.group_sizes == (2, 2) and data.group_nodes == ((0, 1), (2, 3)) and dp_rank == 3
    same, _ = data_parallel(placement, dp_size=4, nodes_per_group=2)
    assert same == data
    assert "groups spanning 2 nodes" in data.describe()
    for bad in (0, -1, True, 1.5):
        with pytest.raises(LayoutError, match="nodes_per_group must be an int >= 1"):
            data_parallel(placement, nodes_per_group=bad)
