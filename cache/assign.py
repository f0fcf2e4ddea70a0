"""Which shards this node warms: the planner's pure function, for a `Placement`. This module is the
cache's single seam to `shardtool.plan`, so the warmer and the loader agree by construction.
"""

from __future__ import annotations

from ..format.summaries import ShardSummaries
from ..plan import DataLayout, Placement, shards_for_node

__all__ = ["assigned_shards"]


def assigned_shards(
    summaries: ShardSummaries, placement: Placement | None, data_layout: DataLayout | None = None
) -> list[int]:
    """The shards node ``placement.node`` reads (every shard when ``placement`` is None, i.e. --all).

    ``data_layout``: who reads what when model-parallel peers span nodes (from a mesh); pure data
    parallelism over the placement's layout when None.
    """
    if placement is None:
        return [s for s in range(summaries.num_shards)]
    layout = data_layout if data_layout is not None else DataLayout.pure_dp(placement.layout)
    if (
        len(layout.group_nodes)
        and max((max(n, default=-1) for n in layout.group_nodes), default=-1) >= placement.layout.num_nodes
    ):
        raise ValueError(
            f"the data layout names nodes beyond the {placement.layout.num_nodes} of {placement.describe()}"
        )
    return shards_for_node(summaries, layout, placement.node)
