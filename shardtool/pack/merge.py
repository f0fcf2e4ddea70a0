"""``shardtool merge OUT``: combine the task fragments of a job array into one manifest.

Checks that every task 0..T-1 has finished, that all agree on format, fields and length
definition, and that sample keys are unique across tasks; shards are listed in task order
(tasks own contiguous, ordered slices of the input, so that is input order).
"""

from __future__ import annotations

import glob
import json
import os
import re

import numpy as np

from ..format.errors import FormatError, ShardtoolError
from ..format.fields import FieldSpec
from ..format.hashing import hash_bytes
from ..format.manifest import Manifest, ShardInfo, lengths_from_bytes
from ..format.sindex import ShardIndex
from ..format.writer import publish_manifest
from . import outdir
from .options import strip_file_scheme

_FRAG_RE = re.compile(r"task-(\d{4})-of-(\d{4})\.json$")


def _load(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            d = json.loads(f.read())
    except (OSError, ValueError) as e:
        raise FormatError(f"{path}: unreadable task fragment ({e})") from None
    if d.get("shardtool") != "task-fragment":
        raise FormatError(f"{path}: not a shardtool task fragment")
    return d


def _named(missing: list[int], have: dict[int, str], num_tasks: int) -> str:
    """The missing tasks as a user reruns them: by SLURM array task id where a finished task
    recorded its array (places count from 0: ``--array=1-4`` puts id 3 at place 2), and how. A
    rerun array of its own (``--array=3,4``) numbers its tasks anew, so each gets its place."""
    array = None
    for path in have.values():
        try:
            got = _load(path).get("slurm_array")
        except FormatError:
            continue
        if isinstance(got, dict) and isinstance(got.get("first"), int) and isinstance(got.get("step"), int):
            array = (got["first"], got["step"])
            break
    more = " …" if len(missing) > 20 else ""
    places = ",".join(map(str, missing[:20])) + more
    if array is None:
        return f"places {places} (from 0); rerun each with --num-tasks {num_tasks} --task-index PLACE"
    first, step = array
    ids = ",".join(str(first + t * step) for t in missing[:20]) + more
    place = f"SLURM_ARRAY_TASK_ID - {first}" if step == 1 else f"(SLURM_ARRAY_TASK_ID - {first}) / {step}"
    return (
        f"SLURM array task ids {ids} (places {places}); rerun them with, e.g., sbatch --array={ids} "
        f"... --num-tasks {num_tasks} --task-index $(({place}))"
    )


def merge(out: str, *, num_tasks: int | None = None) -> dict:
    """Write ``out/index.json`` from ``out/tasks/*``; returns a summary dict."""
    out = strip_file_scheme(out)
    frags: dict[int, dict[int, str]] = {}  # task count -> task index -> fragment path
    for path in sorted(glob.glob(os.path.join(out, outdir.TASKS_DIR, "task-*-of-*.json"))):
        m = _FRAG_RE.search(path)
        if m:
            frags.setdefault(int(m.group(2)), {})[int(m.group(1))] = path
    if not frags:
        raise ShardtoolError(f"{out}: no task fragments in {outdir.TASKS_DIR}/ (run pack with --num-tasks first)")
    if num_tasks is None:
        if len(frags) > 1:
            raise ShardtoolError(f"{out}: fragments of several job arrays ({sorted(frags)} tasks); pass --num-tasks")
        num_tasks = next(iter(frags))
    have = frags.get(num_tasks, {})
    missing = [t for t in range(num_tasks) if t not in have]
    if missing:
        raise ShardtoolError(
            f"{out}: {len(missing)} of {num_tasks} tasks have not finished: {_named(missing, have, num_tasks)}"
        )
    bodies = [_load(have[t]) for t in range(num_tasks)]
    first = bodies[0]
    for t, b in enumerate(bodies):
        for k in ("shard_format", "fields", "length", "compression", "extra"):
            if b.get(k) != first.get(k):
                raise ShardtoolError(f"task {t} disagrees with task 0 on {k}: {b.get(k)!r} vs {first.get(k)!r}")
    _check_inputs(bodies)
    fields = [FieldSpec.from_dict(f) for f in first["fields"]]
    shards: list[ShardInfo] = []
    lengths = []
    for t, b in enumerate(bodies):
        lf = b["lengths"]
        with open(os.path.join(out, lf["path"]), "rb") as f:
            data = f.read()
        if hash_bytes(data) != lf["hash"]:
            raise FormatError(f"{lf['path']}: does not match its task fragment's hash")
        infos = [ShardInfo.from_dict(s, i) for i, s in enumerate(b["shards"])]
        lengths.append(lengths_from_bytes(data, expected=sum(s.samples for s in infos), source=lf["path"]))
        shards.extend(infos)
    _check_keys(out, shards, fields, first["shard_format"] == "tar")
    all_lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    if all_lengths.size == 0:
        raise ShardtoolError(f"{out}: the job array packed no samples")
    outdir.remove_orphans(out, {p for s in shards for p in (s.path, s.index)})
    publish_manifest(
        out,
        Manifest(
            first["shard_format"],
            fields,
            shards,
            first["length"],
            extra=dict(first.get("extra") or {}),
            compression=first.get("compression"),
        ),
        all_lengths,
    )
    skipped = [s for b in bodies for s in b.get("skipped", [])]
    return {
        "out": out,
        "tasks": num_tasks,
        "shards": len(shards),
        "samples": int(all_lengths.size),
        "bytes": sum(s.bytes for s in shards),
        "skipped": skipped,
        "dropped": sum(b.get("dropped", 0) for b in bodies),
        "truncated": sum(b.get("truncated", 0) for b in bodies),
    }


def _check_inputs(bodies: list[dict]) -> None:
    """Tasks split one list of units: a task that found other sources than task 0 packed another
    split, so samples would be missing or twice over (fragments from before it record none)."""
    first = bodies[0].get("inputs")
    for t, b in enumerate(bodies):
        seen = b.get("inputs")
        if first is None or seen is None or seen == first:
            continue
        raise ShardtoolError(
            f"task {t} found other inputs than task 0: {_inputs(seen)} against {_inputs(first)}. Each task "
            "splits the same list of sources, so the sources changed while the array ran (a glob that matched "
            "other files, a file written meanwhile) and samples would be missing or packed twice; rerun the "
            "tasks that differ with the same sources, or the whole array"
        )


def _inputs(seen: dict) -> str:
    return (
        f"{seen['sources']} sources ({seen['units']} pieces of work, {seen['skipped']} skipped, "
        f"digest {seen['digest']})"
    )


def _check_keys(out: str, shards: list[ShardInfo], fields: list[FieldSpec], tar: bool) -> None:
    owner: dict[str, str] = {}
    names = [f.name for f in fields]
    for s in shards:
        try:
            with open(os.path.join(out, s.index), "rb") as f:
                data = f.read()
        except OSError as e:
            raise FormatError(f"{s.index}: missing sample index ({e})") from None
        if hash_bytes(data) != s.index_hash:
            raise FormatError(f"{s.index}: does not match the hash its task recorded")
        for k in ShardIndex.from_bytes(data, names, shard=s.path, tar=tar).keys:
            prev = owner.setdefault(k, s.path)
            if prev != s.path:
                raise ShardtoolError(f"duplicate key {k!r} in {prev} and {s.path}")
