"""A node cache warmed for another data layout than the loader reads, said at the loader's start.

`shardtool warm` records the layout it assigned a node's shards for (`.shardtool/assigned.json`).
A loader given other groups (``nodes_per_group``, ``dp_size``, a mesh, or another number of
nodes) reads shards the warm did not copy: with the source there each is fetched on a miss,
stalling batches; with the source gone, the read fails naming only a shard. The warning names
both layouts and the options that must match.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["warmed_layout_mismatch"]

_COMPARED = ("dp_size", "data_groups", "node_groups", "node_dp_ranks", "describe")


def warmed_layout_mismatch(cache: Any, placement: Any, data_layout: Any) -> str | None:
    """The warning for ``cache`` (a `shardtool.cache.DatasetCache`), or None when its last warm
    assigned this node's shards for the loader's layout (or warmed every shard, or never ran)."""
    from ..cache.report import data_layout_dict  # lazy: only a loader with a cache imports it

    try:
        with open(cache.vdir.assigned_path) as f:
            recorded = json.load(f)
    except (OSError, ValueError):
        return None
    warmed = recorded.get("layout") or {}
    if warmed.get("all") or not isinstance(warmed.get("data_layout"), dict):
        return None
    ours = data_layout_dict(data_layout, placement.node)
    same_nodes = (warmed.get("num_nodes"), warmed.get("ranks_per_node")) == (
        placement.layout.num_nodes,
        placement.layout.ranks_per_node,
    )
    theirs = warmed["data_layout"]
    if same_nodes and warmed.get("node") == placement.node and all(theirs.get(k) == ours[k] for k in _COMPARED):
        return None
    return (
        f"the node cache {cache.cache_dir} was warmed for node {warmed.get('node')} of "
        f"{warmed.get('num_nodes')} x {warmed.get('ranks_per_node')} rank(s), {theirs.get('describe')}; this "
        f"loader is node {placement.node} of {placement.layout.describe()}, {data_layout.describe()}: the "
        "shards it reads are not all cached. Warm with the loader's layout (shardtool warm --nodes, "
        "--ranks-per-node, --nodes-per-group, --dp-size or --mesh as the loader has them)"
    )
