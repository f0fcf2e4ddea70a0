"""Which shards this node warms: the planner's pure function, and the node layout from the CLI
or SLURM. This module is the single seam to ``loader.plan`` so the warmer and the loader agree
by construction.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from loader.plan import shards_for_node

from .errors import UsageError

__all__ = ["NodeLayout", "resolve_node_layout", "assigned_shards", "shards_for_node"]


@dataclass(frozen=True)
class NodeLayout:
    node: int
    num_nodes: int
    ranks_per_node: int | None = None  # recorded only: the node's shards do not depend on it

    def to_dict(self) -> dict:
        return {"node": self.node, "num_nodes": self.num_nodes, "ranks_per_node": self.ranks_per_node}


def _int(env: Mapping[str, str], name: str) -> int | None:
    raw = (env.get(name) or "").strip()
    if not raw:
        return None
    m = re.match(r"^(\d+)", raw)  # SLURM writes "4(x2)" for repeated counts
    if not m:
        raise UsageError(f"environment variable {name}={raw!r} is not an integer")
    return int(m.group(1))


def resolve_node_layout(nodes: int | None = None, node_rank: int | None = None,
                        ranks_per_node: int | None = None, *, env: Mapping[str, str]) -> NodeLayout:
    """Explicit arguments first, then SLURM: SLURM_JOB_NUM_NODES (or SLURM_NNODES), SLURM_NODEID,
    SLURM_NTASKS_PER_NODE or SLURM_GPUS_ON_NODE. One node when nothing says otherwise."""
    if nodes is None:
        nodes = _int(env, "SLURM_JOB_NUM_NODES") or _int(env, "SLURM_NNODES")
    if node_rank is None:
        node_rank = _int(env, "SLURM_NODEID")
    if ranks_per_node is None:
        ranks_per_node = _int(env, "SLURM_NTASKS_PER_NODE") or _int(env, "SLURM_GPUS_ON_NODE")
    if nodes is None:
        if node_rank not in (None, 0):
            raise UsageError(f"node rank {node_rank} given without a node count (--nodes)")
        nodes = 1
    if nodes < 1:
        raise UsageError(f"--nodes must be >= 1, found {nodes}")
    if node_rank is None:
        if nodes != 1:
            raise UsageError(f"{nodes} nodes but no node rank: pass --node-rank (SLURM_NODEID is not set in a prolog)")
        node_rank = 0
    if not 0 <= node_rank < nodes:
        raise UsageError(f"node rank {node_rank} is outside [0, {nodes})")
    if ranks_per_node is not None and ranks_per_node < 1:
        raise UsageError(f"--ranks-per-node must be >= 1, found {ranks_per_node}")
    return NodeLayout(node_rank, nodes, ranks_per_node)


def assigned_shards(lengths, shard_counts, layout: NodeLayout | None) -> list[int]:
    """The shards this node reads (every shard when ``layout`` is None, i.e. --all)."""
    if layout is None:
        return list(range(len(shard_counts)))
    return shards_for_node(lengths, shard_counts, layout.node, layout.num_nodes)
