"""The one reader of the job's environment: torchrun's and SLURM's variables, and explicit overrides.

The loader (a rank), the cache warmer (a node) and pack (a job-array task) all read their place in
the job here. The environment is an argument, so precedence — explicit argument > initialised
``torch.distributed`` > torchrun > SLURM > default — is testable without touching ``os.environ``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ..format.errors import ShardtoolError
from .layout import Layout, Placement, require_positive_int

__all__ = ["LayoutError", "array_ids", "array_task", "node_placement", "rank_placement", "slurm_tasks_per_node"]


class LayoutError(ShardtoolError, ValueError):
    """The job's layout cannot be read, or what was read is inconsistent."""


def _int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw.strip())
    except ValueError:
        raise LayoutError(f"environment variable {name} must be an integer, found {raw!r}") from None


_TASKS_ITEM = re.compile(r"^\s*(\d+)\s*(?:\(x(\d+)\))?\s*$")


def slurm_tasks_per_node(env: Mapping[str, str]) -> int | None:
    """Tasks per node from SLURM_NTASKS_PER_NODE, else SLURM_TASKS_PER_NODE.

    SLURM writes these as "2", "2(x3)" (2 on each of 3 nodes) or "2(x3),1"; a Layout has one
    ranks-per-node for every node, so an uneven allocation is refused rather than mis-assigned.
    """
    for name in ("SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        raw = env.get(name)
        if raw is None or raw.strip() == "":
            continue
        counts = set()
        for item in raw.split(","):
            match = _TASKS_ITEM.match(item)
            if match is None:
                raise LayoutError(f"{name} must look like '2' or '2(x3)', found {raw!r}")
            counts.add(int(match.group(1)))
        if len(counts) != 1:
            raise LayoutError(
                f"uneven tasks per node are not supported: {name}={raw!r}; ask SLURM for the same "
                "number of tasks on every node (--ntasks-per-node) or pass ranks_per_node explicitly"
            )
        return counts.pop()
    return None


def _detect_rank(env: Mapping[str, str], dist: Any) -> tuple[int | None, int | None, int | None, str]:
    """(rank, world_size, ranks_per_node, source) from the first source that has them."""
    if dist is not None and dist.is_available() and dist.is_initialized():
        local = _int(env, "LOCAL_WORLD_SIZE")
        if local is None and "SLURM_PROCID" in env:
            local = slurm_tasks_per_node(env)
        return dist.get_rank(), dist.get_world_size(), local, "torch.distributed"
    if "RANK" in env and "WORLD_SIZE" in env:
        return _int(env, "RANK"), _int(env, "WORLD_SIZE"), _int(env, "LOCAL_WORLD_SIZE"), "torchrun"
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS"), slurm_tasks_per_node(env), "SLURM"
    return None, None, None, "default"


def rank_placement(
    rank: int | None = None,
    world_size: int | None = None,
    ranks_per_node: int | None = None,
    *,
    env: Mapping[str, str],
    dist: Any = None,
) -> Placement:
    """This process's rank and layout.

    Each value comes from the first place that has it: the explicit argument, an initialised
    ``torch.distributed`` (`dist`; ranks per node from LOCAL_WORLD_SIZE), torchrun's RANK /
    WORLD_SIZE / LOCAL_WORLD_SIZE, SLURM's SLURM_PROCID / SLURM_NTASKS / SLURM_NTASKS_PER_NODE,
    and finally a single process (0 of 1). Unknown ranks per node means one node holding the
    whole world.
    """
    found_rank, found_world, found_local, source = _detect_rank(env, dist)
    explicit = [v is not None for v in (rank, world_size, ranks_per_node)]
    if all(explicit) or (any(explicit) and source == "default"):
        source = "arguments"
    elif any(explicit):
        source = f"arguments and {source}"
    rank = rank if rank is not None else found_rank
    world_size = world_size if world_size is not None else found_world
    ranks_per_node = ranks_per_node if ranks_per_node is not None else found_local
    world_size = 1 if world_size is None else world_size
    rank = 0 if rank is None else rank
    try:
        require_positive_int("world_size", world_size)
        ranks_per_node = world_size if ranks_per_node is None else ranks_per_node
        require_positive_int("ranks_per_node", ranks_per_node)
        if world_size % ranks_per_node != 0:
            raise ValueError(
                f"world_size must be a multiple of ranks_per_node: found world_size={world_size}, "
                f"ranks_per_node={ranks_per_node}"
            )
        layout = Layout(world_size // ranks_per_node, ranks_per_node)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), found {rank!r}")
    except ValueError as e:
        raise LayoutError(f"{e} (layout from {source})") from None
    return Placement(layout, layout.node_of(rank), rank, source)


def node_placement(
    num_nodes: int | None = None, node: int | None = None, ranks_per_node: int | None = None, *, env: Mapping[str, str]
) -> Placement:
    """This node's index and the layout, for work done once per node (the cache warmer).

    Explicit arguments first, then SLURM: SLURM_JOB_NUM_NODES (or SLURM_NNODES), SLURM_NODEID,
    tasks per node (SLURM_NTASKS_PER_NODE, SLURM_TASKS_PER_NODE) or SLURM_GPUS_ON_NODE. One node
    when nothing says otherwise. Ranks per node defaults to 1 when unknown: a node's share of the
    data does not depend on it.
    """
    used: list[str] = []

    def pick(value, *names):
        if value is not None:
            used.append("arguments")
            return value
        for name in names:
            found = slurm_tasks_per_node(env) if name == "TASKS" else _int(env, name)
            if found is not None:
                used.append(name if name != "TASKS" else "SLURM_NTASKS_PER_NODE")
                return found
        return None

    num_nodes = pick(num_nodes, "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
    node = pick(node, "SLURM_NODEID")
    ranks_per_node = pick(ranks_per_node, "TASKS", "SLURM_GPUS_ON_NODE")
    if num_nodes is None:
        if node not in (None, 0):
            raise LayoutError(f"node rank {node} given without a node count (--nodes / SLURM_JOB_NUM_NODES)")
        num_nodes = 1
    if node is None:
        if num_nodes != 1:
            raise LayoutError(
                f"{num_nodes} nodes but no node rank: pass --node-rank (SLURM_NODEID is not set in a prolog)"
            )
        node = 0
    sources = sorted(set(used))
    source = ", ".join(sources) if sources else "default: one node (no --nodes, no SLURM environment)"
    try:
        layout = Layout(num_nodes, 1 if ranks_per_node is None else ranks_per_node)
        return Placement(layout, node, None, source)
    except ValueError as e:
        raise LayoutError(f"{e} (layout from {source})") from None


def array_task(num_tasks: int | None, task_index: int | None, *, env: Mapping[str, str]) -> tuple[int, int]:
    """(count, index) of this job-array task: explicit arguments, else SLURM_ARRAY_*, else (1, 0).

    SLURM numbers array tasks from ``SLURM_ARRAY_TASK_MIN`` (usually 0 or 1) in steps of
    ``SLURM_ARRAY_TASK_STEP``; the index is the task's place in that range, so ``--array=1-8`` and
    ``--array=0-70:10`` work as well as ``--array=0-7``. A listed array (``--array=1,3,7``) has no
    such place: it needs ``--task-index``.
    """
    if num_tasks is None:
        num_tasks = _int(env, "SLURM_ARRAY_TASK_COUNT")
    if task_index is None and num_tasks is not None and num_tasks > 1:
        found = _int(env, "SLURM_ARRAY_TASK_ID")
        if found is not None:
            task_index = _array_place(env, found, num_tasks)
    num_tasks = 1 if num_tasks is None else int(num_tasks)
    task_index = 0 if task_index is None else int(task_index)
    if num_tasks < 1:
        raise LayoutError(f"--num-tasks must be >= 1, found {num_tasks}")
    if not 0 <= task_index < num_tasks:
        raise LayoutError(f"--task-index {task_index} is outside 0..{num_tasks - 1}")
    return num_tasks, task_index


def array_ids(num_tasks: int, task_index: int | None, *, env: Mapping[str, str]) -> tuple[int, int] | None:
    """(first id, step) of the SLURM job array whose ids `array_task` read this task's place from,
    so that a task's place p is SLURM task id first + p * step (what `merge` names and a user
    resubmits); None where the place was given (``task_index``) or no array id is set."""
    if task_index is not None or num_tasks <= 1 or _int(env, "SLURM_ARRAY_TASK_ID") is None:
        return None
    return _int(env, "SLURM_ARRAY_TASK_MIN") or 0, _int(env, "SLURM_ARRAY_TASK_STEP") or 1


def _array_place(env: Mapping[str, str], found: int, num_tasks: int) -> int:
    """Task ``found``'s place in the array ``SLURM_ARRAY_TASK_MIN..MAX:STEP`` of ``num_tasks`` ids."""
    first, step = _int(env, "SLURM_ARRAY_TASK_MIN") or 0, _int(env, "SLURM_ARRAY_TASK_STEP") or 1
    last = _int(env, "SLURM_ARRAY_TASK_MAX")
    if last is not None and (last - first) // step + 1 != num_tasks:
        raise LayoutError(
            f"this job array's {num_tasks} task ids are not the range {first}-{last}"
            + (f":{step}" if step > 1 else "")
            + " (a listed array such as --array=1,3,7?): their places cannot be told from "
            "SLURM_ARRAY_TASK_ID; give --num-tasks and --task-index, or submit --array=0-"
            f"{num_tasks - 1}"
        )
    if (found - first) % step:
        raise LayoutError(f"SLURM_ARRAY_TASK_ID {found} is not in the array {first}-{last}:{step}")
    return (found - first) // step
