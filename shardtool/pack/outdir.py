"""The output directory: preparing it for a (re)run, task fragments, orphan clean-up.

A rerun after a kill must give the same dataset: stale temp files of *this* task are removed
(never another task's, which may be writing right now), the old manifest is removed before any
shard is rewritten, and shards no manifest will reference are deleted before publishing. A pack
``--overwrite`` of a published dataset writes the new one beside it instead (`swap_in`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from dataclasses import dataclass

import numpy as np

from ..format.atomic import TMP_PREFIX, atomic_write_bytes, remove_stale_temps
from ..format.errors import ShardtoolError
from ..format.manifest import LENGTHS_NAME, MANIFEST_NAME, lengths_to_bytes

# Where `pack --overwrite` writes the new dataset, inside OUT, while the old one stays published.
OVERWRITE_DIR = ".shardtool-overwrite"
SHARD_RE = re.compile(r"t\d{4}-w\d{2}-\d{6}\.(tar|arrow|idx\.arrow)$")
TASKS_DIR = "tasks"


def fragment_name(task: int, num_tasks: int) -> str:
    return f"{TASKS_DIR}/task-{task:04d}-of-{num_tasks:04d}.json"


@dataclass(frozen=True)
class Before:
    """What the output directory held before a pack touched it (see :func:`undo`)."""

    out_existed: bool
    shards_existed: bool
    shard_files: frozenset


def snapshot(out: str) -> Before:
    try:
        names = frozenset(os.listdir(os.path.join(out, "shards")))
        shards_existed = True
    except (FileNotFoundError, NotADirectoryError):
        names, shards_existed = frozenset(), False
    return Before(os.path.isdir(out), shards_existed, names)


def undo(out: str, before: Before, *, task: int, num_tasks: int) -> None:
    """Remove what a failed pack of ``task`` created, never what was there before: its temps and
    the shard files it published (no manifest references them), and, packing alone, the
    ``shards/`` and ``OUT`` directories it made (in a job array another task may be using them).
    Does nothing once this pack's manifest or fragment is published."""
    mine = os.path.join(out, MANIFEST_NAME if num_tasks == 1 else fragment_name(task, num_tasks))
    if os.path.exists(mine):
        return
    remove_task_temps(out, task)
    shard_dir = os.path.join(out, "shards")
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(shard_dir):
            if SHARD_RE.match(name) and name.startswith(f"t{task:04d}-") and name not in before.shard_files:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(shard_dir, name))
    if num_tasks != 1:
        return
    with contextlib.suppress(FileNotFoundError):  # written just before the manifest, useless without it
        os.unlink(os.path.join(out, LENGTHS_NAME))
    for made, path in ((not before.shards_existed, shard_dir), (not before.out_existed, out)):
        if made:
            with contextlib.suppress(OSError):  # not empty: something else is in there; keep it
                os.rmdir(path)


def prepare(out: str, *, task: int, num_tasks: int, overwrite: bool) -> None:
    manifest = os.path.join(out, MANIFEST_NAME)
    if os.path.exists(manifest) and not overwrite:
        raise ShardtoolError(f"{out} already holds a dataset ({MANIFEST_NAME}); pass --overwrite to replace it")
    os.makedirs(os.path.join(out, "shards"), exist_ok=True)
    # The manifest goes first: from here on no reader trusts shards we are about to rewrite.
    for name in (MANIFEST_NAME, LENGTHS_NAME):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(out, name))
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(out, fragment_name(task, num_tasks)))
    remove_task_temps(out, task)
    # Temps of a manifest (or of this task's fragment) whose writer was killed mid-publish.
    stale = [(out, f"{TMP_PREFIX}{MANIFEST_NAME}."), (out, f"{TMP_PREFIX}{LENGTHS_NAME}.")] if num_tasks == 1 else []
    frag = os.path.basename(fragment_name(task, num_tasks)).rsplit(".", 1)[0]
    stale.append((os.path.join(out, TASKS_DIR), f"{TMP_PREFIX}{frag}."))
    for directory, prefix in stale:
        remove_stale_temps(directory, prefix)


def remove_task_temps(out: str, task: int) -> None:
    """Delete this task's temp shard files (never another task's, which may be writing now)."""
    remove_stale_temps(os.path.join(out, "shards"), f"{TMP_PREFIX}t{task:04d}-")


def remove_orphans(out: str, keep: set[str], *, task: int | None = None) -> int:
    """Delete shard/index files matching our naming scheme that ``keep`` does not list."""
    shard_dir = os.path.join(out, "shards")
    n = 0
    for name in os.listdir(shard_dir):
        if not SHARD_RE.match(name) or (task is not None and not name.startswith(f"t{task:04d}-")):
            continue
        if f"shards/{name}" not in keep:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(shard_dir, name))
                n += 1
    return n


def task_words(task: int, num_tasks: int, array: tuple[int, int] | None) -> str:
    """A job-array task as a user submitted it: its place, and its SLURM array task id where known."""
    return f"task {task}/{num_tasks}" + (f" (SLURM array task {array[0] + task * array[1]})" if array else "")


def write_fragment(
    out: str, task: int, num_tasks: int, body: dict, lengths: np.ndarray, array: tuple[int, int] | None = None
) -> str:
    """Task ``task``'s fragment for `merge`; ``array``: (first id, step) of the SLURM array it ran
    in (`shardtool.plan.env.array_ids`), so that merge names missing tasks by their SLURM ids."""
    from ..format.hashing import hash_bytes

    data = lengths_to_bytes(lengths)
    lengths_rel = f"{TASKS_DIR}/task-{task:04d}-of-{num_tasks:04d}.lengths.npy"
    atomic_write_bytes(os.path.join(out, lengths_rel), data)
    body = {**body, "lengths": {"path": lengths_rel, "hash": hash_bytes(data), "bytes": len(data)}}
    if array is not None:
        body["slurm_array"] = {"first": array[0], "step": array[1]}
    rel = fragment_name(task, num_tasks)
    atomic_write_bytes(os.path.join(out, rel), (json.dumps(body, indent=1) + "\n").encode())
    return rel


def overwrite_staging(out: str) -> str:
    """An empty directory inside ``out`` for the new dataset of ``pack --overwrite`` (what a killed
    overwrite left there is removed): the old dataset stays published until `swap_in`."""
    drop_staging(out)
    return os.path.join(out, OVERWRITE_DIR)


def drop_staging(out: str) -> None:
    shutil.rmtree(os.path.join(out, OVERWRITE_DIR), ignore_errors=True)


def swap_in(out: str, staging: str) -> None:
    """Replace the dataset in ``out`` by the whole one in ``staging``: the old manifest goes
    first (no reader trusts shards about to be replaced), then the new shards and files, the new
    manifest last; then the old shards no manifest names. Renames within one filesystem: a kill
    in here leaves no manifest, and a rerun packs afresh."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(out, MANIFEST_NAME))
    os.makedirs(os.path.join(out, "shards"), exist_ok=True)
    keep = set()
    for name in sorted(os.listdir(os.path.join(staging, "shards"))):
        os.replace(os.path.join(staging, "shards", name), os.path.join(out, "shards", name))
        keep.add(f"shards/{name}")
    for name in sorted(os.listdir(staging)):
        if name not in ("shards", MANIFEST_NAME):
            os.replace(os.path.join(staging, name), os.path.join(out, name))
    os.replace(os.path.join(staging, MANIFEST_NAME), os.path.join(out, MANIFEST_NAME))
    shutil.rmtree(staging, ignore_errors=True)
    remove_orphans(out, keep)
