"""Data-parallel layouts from a device mesh: which DP rank every global rank is, and the data groups.

A mesh is an array of global ranks with one named dimension per kind of parallelism, e.g.
``pp=2,dp=4,tp=2`` (row-major: the last dimension varies fastest, as torch's DeviceMesh and
Megatron's rank orders lay them out). The data-parallel dimensions (one, or several for HSDP's
replicate × shard) give each rank its DP index; the other dimensions are its replicas, which must
see the same batches. Two DP ranks belong to one data group when their replicas share a node, so
that each node caches exactly the ranges its ranks read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .env import LayoutError
from .layout import DataLayout, Layout, Placement, node_blocks

__all__ = ["Mesh", "as_mesh", "data_layout", "data_parallel", "parse_mesh"]


@dataclass(frozen=True, eq=False)
class Mesh:
    """``ranks[c0, c1, ...]`` is the global rank at mesh coordinates (c0, c1, ...)."""

    names: tuple[str, ...]
    ranks: np.ndarray

    def __post_init__(self) -> None:
        if len(set(self.names)) != len(self.names) or self.ranks.ndim != len(self.names):
            raise LayoutError(
                f"a mesh needs one distinct name per dimension: found {self.names} for shape {self.ranks.shape}"
            )
        flat = np.sort(self.ranks.reshape(-1))
        if not np.array_equal(flat, np.arange(flat.size)):
            raise LayoutError(f"mesh ranks must be 0..{flat.size - 1}, each once")

    @classmethod
    def row_major(cls, names: Sequence[str], sizes: Sequence[int]) -> Mesh:
        for name, size in zip(names, sizes):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise LayoutError(f"mesh dimension {name}={size!r} must be an int >= 1")
        total = int(np.prod(sizes)) if sizes else 1
        return cls(tuple(names), np.arange(total, dtype=np.int64).reshape(tuple(sizes)))

    @property
    def shape(self) -> dict[str, int]:
        return dict(zip(self.names, self.ranks.shape))

    def describe(self) -> str:
        return ",".join(f"{n}={s}" for n, s in zip(self.names, self.ranks.shape))


def as_mesh(mesh: Any) -> Mesh | None:
    """A Mesh from a torch DeviceMesh (its rank tensor and dimension names, read by attribute: no
    torch import here), a Mesh, or None."""
    if mesh is None or isinstance(mesh, Mesh):
        return mesh
    names = getattr(mesh, "mesh_dim_names", None)
    ranks = getattr(mesh, "mesh", None)
    if names is None or ranks is None:
        raise ValueError(
            "mesh must be a torch.distributed.device_mesh.DeviceMesh with mesh_dim_names, or a "
            f"shardtool.plan.Mesh; found {type(mesh).__name__}"
        )
    return Mesh(tuple(names), np.asarray(ranks.cpu().numpy() if hasattr(ranks, "cpu") else ranks, dtype=np.int64))


def parse_mesh(text: str) -> Mesh:
    """``"pp=2,dp=4,tp=2"`` → a row-major mesh of 16 ranks."""
    names, sizes = [], []
    for item in (p.strip() for p in text.split(",") if p.strip()):
        name, sep, value = item.partition("=")
        if not sep or not name.strip().isidentifier() or not value.strip().isdigit():
            raise LayoutError(f"mesh {text!r}: each dimension must look like name=size (e.g. pp=2,dp=4,tp=2)")
        names.append(name.strip())
        sizes.append(int(value))
    if not names:
        raise LayoutError(f"mesh {text!r} names no dimension")
    return Mesh.row_major(names, sizes)


def _dp_index(mesh: Mesh, dp_dims: Sequence[str]) -> np.ndarray:
    """DP index of every global rank (dp_index[rank])."""
    missing = [d for d in dp_dims if d not in mesh.names]
    if missing or not dp_dims:
        raise LayoutError(f"data-parallel dimension(s) {list(dp_dims)} not in the mesh {mesh.describe()}")
    axes = [mesh.names.index(d) for d in dp_dims]
    coords = np.indices(mesh.ranks.shape).reshape(len(mesh.names), -1)
    dp = np.ravel_multi_index(tuple(coords[a] for a in axes), tuple(mesh.ranks.shape[a] for a in axes))
    out = np.empty(mesh.ranks.size, dtype=np.int64)
    out[mesh.ranks.reshape(-1)] = dp
    return out


def data_layout(
    mesh: Mesh, dp_dims: Sequence[str], layout: Layout, nodes_per_group: int = 1
) -> tuple[DataLayout, np.ndarray]:
    """(DataLayout, dp_index per global rank) for a mesh laid over ``layout``'s nodes; with
    ``nodes_per_group`` k, replicas on nodes of one block of k (`node_blocks`) join their groups."""
    if mesh.ranks.size != layout.world_size:
        raise LayoutError(
            f"the mesh {mesh.describe()} has {mesh.ranks.size} ranks, the job {layout.world_size} ({layout.describe()})"
        )
    dp = _dp_index(mesh, dp_dims)
    dp_size = int(dp.max()) + 1
    node = np.arange(layout.world_size) // layout.ranks_per_node
    block = np.empty(layout.num_nodes, dtype=np.int64)
    for b, block_nodes in enumerate(node_blocks(layout.num_nodes, nodes_per_group)):
        block[list(block_nodes)] = b
    # Union-find over DP ranks: two DP ranks are one group when their replicas share a node (a block).
    parent = list(range(dp_size))

    def root(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    first_on_node: dict[int, int] = {}
    for d, n in zip(dp.tolist(), block[node].tolist()):
        other = first_on_node.setdefault(n, d)
        ra, rb = root(d), root(other)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    members: dict[int, list[int]] = {}
    for d in range(dp_size):
        members.setdefault(root(d), []).append(d)
    groups = sorted(members.values())
    sizes = []
    group_of_dp = np.empty(dp_size, dtype=np.int64)
    start = 0
    for g, ranks in enumerate(groups):
        if ranks != list(range(start, start + len(ranks))):
            raise LayoutError(
                f"mesh {mesh.describe()} on {layout.describe()}: DP ranks {ranks} share nodes but are not "
                "adjacent; order the mesh so that DP ranks whose peers share nodes have consecutive indices"
            )
        group_of_dp[start : start + len(ranks)] = g
        start += len(ranks)
        sizes.append(len(ranks))
    nodes: list[set[int]] = [set() for _ in groups]
    for g, n in zip(group_of_dp[dp].tolist(), node.tolist()):
        nodes[g].add(n)
    return DataLayout(dp_size, tuple(sizes), tuple(tuple(sorted(s)) for s in nodes)), dp


def data_parallel(
    placement: Placement,
    *,
    dp_rank: int | None = None,
    dp_size: int | None = None,
    mesh: Mesh | None = None,
    dp_dims: Sequence[str] = ("dp",),
    nodes_per_group: int = 1,
) -> tuple[DataLayout, int]:
    """(DataLayout, this rank's DP rank): from a mesh; from ``dp_size`` (and ``dp_rank``) alone,
    taking the mesh as (dp, mp) with the model-parallel ranks of a DP rank adjacent — the layout of
    torch's DeviceMesh((dp, tp)) and of Megatron without pipeline stages across nodes; or pure data
    parallelism, every rank its own DP rank. With model parallelism declared the global rank is
    never used as the DP rank. ``nodes_per_group`` joins the data groups of each block of that many
    consecutive nodes into one (`node_blocks`)."""
    layout, rank = placement.layout, placement.rank
    if rank is None:
        raise LayoutError("a DP rank needs the process's global rank")
    if isinstance(nodes_per_group, bool) or not isinstance(nodes_per_group, int) or nodes_per_group < 1:
        raise LayoutError(f"nodes_per_group must be an int >= 1, found {nodes_per_group!r}")
    if mesh is not None:
        data, dp_of = data_layout(mesh, tuple(dp_dims), layout, nodes_per_group)
        found = int(dp_of[rank])
        if dp_size is not None and dp_size != data.dp_size:
            raise LayoutError(f"dp_size={dp_size} but the mesh {mesh.describe()} has {data.dp_size} DP ranks")
        if dp_rank is not None and dp_rank != found:
            raise LayoutError(f"dp_rank={dp_rank} but rank {rank} is DP rank {found} of the mesh {mesh.describe()}")
        return data, found
    if dp_size is None:
        if dp_rank is not None:
            raise LayoutError("dp_rank needs dp_size (or a mesh)")
        return DataLayout.pure_dp(layout, nodes_per_group), rank
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1 or layout.world_size % dp_size:
        raise LayoutError(f"dp_size must divide the world size {layout.world_size}, found {dp_size!r}")
    mp = Mesh.row_major(("dp", "mp"), (dp_size, layout.world_size // dp_size))
    data, dp_of = data_layout(mp, ("dp",), layout, nodes_per_group)
    if dp_rank is None:
        dp_rank = int(dp_of[rank])
    elif isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
        raise LayoutError(f"dp_rank must be an int in [0, {dp_size}), found {dp_rank!r}")
    return data, dp_rank
