"""The node layout of a training job, and its detection at the edge.

Everything downstream (planning, caching, resume) takes a `Layout` and a rank as
plain arguments; detection happens once, here, from an environment passed in
explicitly so that it can be tested without touching `os.environ`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["Layout", "resolve_layout"]


def _require_positive_int(name: str, value: Any) -> int:
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
        _require_positive_int("num_nodes", self.num_nodes)
        _require_positive_int("ranks_per_node", self.ranks_per_node)

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.ranks_per_node

    def _check_rank(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(
                f"rank must be an int in [0, {self.world_size}) for {self}, found {rank!r}"
            )
        return rank

    def node_of(self, rank: int) -> int:
        return self._check_rank(rank) // self.ranks_per_node

    def local_rank(self, rank: int) -> int:
        return self._check_rank(rank) % self.ranks_per_node


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw.strip())
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, found {raw!r}") from None


_SLURM_TASKS_ITEM = re.compile(r"^\s*(\d+)\s*(?:\(x\d+\))?\s*$")


def _slurm_tasks_per_node(env: Mapping[str, str]) -> int | None:
    """Parse SLURM_NTASKS_PER_NODE, which SLURM writes as "2", "2(x3)" or "2(x3),1"."""
    raw = env.get("SLURM_NTASKS_PER_NODE")
    if raw is None or raw.strip() == "":
        return None
    counts = set()
    for item in raw.split(","):
        match = _SLURM_TASKS_ITEM.match(item)
        if match is None:
            raise ValueError(
                f"SLURM_NTASKS_PER_NODE must look like '2' or '2(x3)', found {raw!r}"
            )
        counts.add(int(match.group(1)))
    if len(counts) != 1:
        # A Layout has one ranks-per-node for every node; an uneven allocation
        # would silently mis-assign ranks to nodes.
        raise ValueError(
            f"uneven tasks per node are not supported: SLURM_NTASKS_PER_NODE={raw!r}"
        )
    return counts.pop()


def _detect(env: Mapping[str, str], dist: Any) -> tuple[int | None, int | None, int | None]:
    """(rank, world_size, ranks_per_node) from the first source that has them, else Nones."""
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), _env_int(env, "LOCAL_WORLD_SIZE")
    if "RANK" in env and "WORLD_SIZE" in env:
        return _env_int(env, "RANK"), _env_int(env, "WORLD_SIZE"), _env_int(env, "LOCAL_WORLD_SIZE")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return _env_int(env, "SLURM_PROCID"), _env_int(env, "SLURM_NTASKS"), _slurm_tasks_per_node(env)
    return None, None, None


def resolve_layout(
    rank: int | None = None,
    world_size: int | None = None,
    ranks_per_node: int | None = None,
    *,
    env: Mapping[str, str],
    dist: Any = None,
) -> tuple[int, Layout]:
    """Return (rank, Layout) for this process.

    Each value comes from the first place that has it: the explicit argument, an
    initialised `torch.distributed` (`dist`, ranks per node from LOCAL_WORLD_SIZE),
    torchrun's RANK / WORLD_SIZE / LOCAL_WORLD_SIZE, SLURM's SLURM_PROCID /
    SLURM_NTASKS / SLURM_NTASKS_PER_NODE, and finally a single process (0 of 1).
    Unknown ranks per node means one node holding the whole world.
    """
    found_rank, found_world, found_local = _detect(env, dist)
    rank = rank if rank is not None else found_rank
    world_size = world_size if world_size is not None else found_world
    ranks_per_node = ranks_per_node if ranks_per_node is not None else found_local
    if world_size is None:
        world_size = 1
    if rank is None:
        rank = 0
    _require_positive_int("world_size", world_size)
    if ranks_per_node is None:
        ranks_per_node = world_size
    _require_positive_int("ranks_per_node", ranks_per_node)
    if world_size % ranks_per_node != 0:
        raise ValueError(
            f"world_size must be a multiple of ranks_per_node: found world_size={world_size}, "
            f"ranks_per_node={ranks_per_node}"
        )
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), found {rank!r}")
    return rank, Layout(world_size // ranks_per_node, ranks_per_node)
