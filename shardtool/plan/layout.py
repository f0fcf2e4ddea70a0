"""The physical layout of a training job: nodes × ranks per node, and where one process sits in it.

Everything downstream (planning, caching, resume) takes a `Layout` and a rank or node as plain
arguments; reading them from the environment happens once, at the edge (`shardtool.plan.env`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Layout", "Placement", "require_positive_int"]


def require_positive_int(name: str, value: Any) -> int:
    # bool is an int subclass; True ranks per node is a bug, not a 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int >= 1, found {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, found {value}")
    return value


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
            raise ValueError(
                f"rank must be an int in [0, {self.world_size}) for {self}, found {rank!r}"
            )
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
        return {"node": self.node, "num_nodes": self.layout.num_nodes, "ranks_per_node": self.layout.ranks_per_node,
                "rank": self.rank, "from": self.source}
