"""The physical layout of a training job: nodes × ranks per node, and where one process sits in it.

Everything downstream (planning, caching, resume) takes a `Layout` and a rank or node as plain
arguments; reading them from the environment happens once, at the edge (`shardtool.plan.env`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["DataLayout", "Layout", "Placement", "node_blocks", "require_positive_int"]


def require_positive_int(name: str, value: Any) -> int:
    # bool is an int subclass; True ranks per node is a bug, not a 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int >= 1, found {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, found {value}")
    return value


def node_blocks(num_nodes: int, nodes_per_group: int = 1) -> tuple[tuple[int, ...], ...]:
    """The nodes of each data group when groups span ``nodes_per_group`` consecutive nodes (the
    last block shorter when it does not divide; more than ``num_nodes``: one group of all).

    One node a group is the default: each node caches its own ranks' range. A group of k nodes
    reads one range that its k nodes each cache whole (k times the disk), and its steps can then be
    balanced by cost across all its ranks, where ranges of single nodes differ by what they hold
    (docs/sequence-packing.md)."""
    k = min(require_positive_int("nodes_per_group", nodes_per_group), num_nodes)
    return tuple(tuple(range(first, min(first + k, num_nodes))) for first in range(0, num_nodes, k))


@dataclass(frozen=True)
class Layout:
    """`num_nodes` nodes of `ranks_per_node` ranks each; rank r lives on node r // ranks_per_node."""

    num_nodes: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        require_positive_int("num_nodes", self.num_nodes)
        require_positive_int("ranks_per_node", self.ranks_per_node)

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.ranks_per_node

    def check_rank(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an int in [0, {self.world_size}) for {self}, found {rank!r}")
        return rank

    def check_node(self, node: int) -> int:
        if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < self.num_nodes:
            raise ValueError(f"node must be an int in [0, {self.num_nodes}) for {self}, found {node!r}")
        return node

    def node_of(self, rank: int) -> int:
        return self.check_rank(rank) // self.ranks_per_node

    def local_rank(self, rank: int) -> int:
        return self.check_rank(rank) % self.ranks_per_node

    def describe(self) -> str:
        return f"{self.num_nodes} node(s) x {self.ranks_per_node} rank(s)"


@dataclass(frozen=True)
class Placement:
    """Where this process sits in a layout, and where that was read from.

    ``rank`` is the process's global rank (None for a whole node, e.g. the cache warmer);
    ``source`` names what the values came from (for logs and the warm summary line).
    """

    layout: Layout
    node: int
    rank: int | None = None
    source: str = "arguments"

    def __post_init__(self) -> None:
        self.layout.check_node(self.node)
        if self.rank is not None and self.layout.node_of(self.rank) != self.node:
            raise ValueError(f"rank {self.rank} lives on node {self.layout.node_of(self.rank)}, not {self.node}")

    def describe(self) -> str:
        where = f"node {self.node} of {self.layout.num_nodes}, {self.layout.ranks_per_node} rank(s) per node"
        if self.rank is not None:
            where = f"rank {self.rank} of {self.layout.world_size}, " + where
        return f"{where} (from {self.source})"

    def to_dict(self) -> dict:
        return {
            "node": self.node,
            "num_nodes": self.layout.num_nodes,
            "ranks_per_node": self.layout.ranks_per_node,
            "rank": self.rank,
            "from": self.source,
        }


@dataclass(frozen=True)
class DataLayout:
    """Who reads what: the data-parallel (DP) size and the *data groups*.

    A data group is a contiguous block of DP ranks that read one contiguous, token-balanced range
    of the data: the DP ranks of one node, or, when model-parallel peers (TP/PP/CP) of a DP rank
    span nodes, every DP rank whose peers share those nodes. ``group_sizes[g]`` DP ranks form group
    g; ``group_nodes[g]`` are the nodes hosting its ranks (what the warmer needs). Replicas — the
    ranks of one DP rank — compute the same plan, so they get byte-identical batches.
    """

    dp_size: int
    group_sizes: tuple[int, ...]
    group_nodes: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        require_positive_int("dp_size", self.dp_size)
        if not self.group_sizes or any(
            isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in self.group_sizes
        ):
            raise ValueError(f"group_sizes must be ints >= 1, found {self.group_sizes!r}")
        if sum(self.group_sizes) != self.dp_size:
            raise ValueError(f"group sizes {self.group_sizes} do not add up to dp_size {self.dp_size}")
        if len(self.group_nodes) != len(self.group_sizes):
            raise ValueError("group_nodes must name the nodes of every group")

    @classmethod
    def pure_dp(cls, layout: Layout, nodes_per_group: int = 1) -> DataLayout:
        """DDP/FSDP: every rank is its own DP rank, and each node's ranks form one group; or the
        ranks of each ``nodes_per_group`` consecutive nodes (`node_blocks`)."""
        blocks = node_blocks(layout.num_nodes, nodes_per_group)
        return cls(layout.world_size, tuple(layout.ranks_per_node * len(b) for b in blocks), blocks)

    @property
    def num_groups(self) -> int:
        return len(self.group_sizes)

    def first_dp_rank(self, group: int) -> int:
        return sum(self.group_sizes[:group])

    def group_of(self, dp_rank: int) -> tuple[int, int]:
        """(group, index of ``dp_rank`` inside its group)."""
        if isinstance(dp_rank, bool) or not isinstance(dp_rank, (int, np.integer)) or not 0 <= dp_rank < self.dp_size:
            raise ValueError(f"dp_rank must be an int in [0, {self.dp_size}), found {dp_rank!r}")
        firsts = np.cumsum([0, *self.group_sizes])
        g = int(np.searchsorted(firsts, dp_rank, side="right")) - 1  # sizes add up to dp_size: g < groups
        return g, int(dp_rank) - int(firsts[g])

    def groups_on_node(self, node: int) -> list[int]:
        return [g for g, nodes in enumerate(self.group_nodes) if node in nodes]

    def identity(self) -> dict:
        """What the plan depends on (the nodes do not change which samples a DP rank reads)."""
        runs: list[list[int]] = []
        for k in self.group_sizes:
            if runs and runs[-1][0] == k:
                runs[-1][1] += 1
            else:
                runs.append([k, 1])
        return {"dp_size": self.dp_size, "groups": runs}

    @classmethod
    def from_identity(cls, data: Mapping[str, Any]) -> DataLayout:
        """The layout a state segment recorded; its nodes are unknown (and never needed to replay it)."""
        sizes = tuple(int(k) for k, count in data["groups"] for _ in range(int(count)))
        return cls(int(data["dp_size"]), sizes, tuple(() for _ in sizes))

    def describe(self) -> str:
        sizes = sorted(set(self.group_sizes))
        per = f"{sizes[0]}" if len(sizes) == 1 else "/".join(map(str, sizes))
        text = f"{self.dp_size} data-parallel rank(s) in {self.num_groups} data group(s) of {per}"
        spans = sorted({len(nodes) for nodes in self.group_nodes if len(nodes) > 1})
        if spans:  # each of those nodes caches the group's whole range
            text += f", groups spanning {'/'.join(map(str, spans))} nodes"
        return text
