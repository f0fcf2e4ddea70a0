"""Which shards this node warms: the planner's pure function, for a `Placement`. This module is the
cache's single seam to `shardtool.plan`, so the warmer and the loader agree by construction.
"""
from __future__ import annotations

from ..plan import Placement, shards_for_node

__all__ = ["assigned_shards"]


def assigned_shards(lengths, shard_counts, placement: Placement | None) -> list[int]:
    """The shards node ``placement.node`` reads (every shard when ``placement`` is None, i.e. --all)."""
    if placement is None:
        return list(range(len(shard_counts)))
    return shards_for_node(lengths, shard_counts, placement.node, placement.layout.num_nodes)
