"""The end of a pack: check the workers' results and publish the manifest (or a task fragment), last.

Kept apart from `api` because it is the only place a pack commits anything: the manifest (or
fragment) is written after every shard, so a failure before it leaves nothing published.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from ..format.errors import BadSampleError, ShardtoolError
from ..format.fields import FieldSpec
from ..format.manifest import Manifest, ShardInfo
from ..format.writer import publish_manifest
from . import outdir
from .skips import check_skips, skipped_samples
from .worker import JobResult


@dataclass
class PackResult:
    out: str
    samples: int
    bytes: int
    shards: int
    seconds: float
    skipped: list[str] = field(default_factory=list)
    manifest: str | None = None  # path of index.json, or None for a job-array task
    fragment: str | None = None
    task: int = 0
    num_tasks: int = 1
    array: tuple[int, int] | None = None  # (first id, step) of the SLURM array the task ran in
    dropped: int = 0  # longer than --max-length, dropped
    truncated: int = 0  # longer than --max-length, cut to it
    warnings: list[str] = field(default_factory=list)

    def summary(self) -> str:
        rate = self.samples / self.seconds if self.seconds > 0 else 0.0
        mbs = self.bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0
        what = "dataset" if self.manifest else f"{outdir.task_words(self.task, self.num_tasks, self.array)} fragment"
        capped = (
            f"dropped {self.dropped} and truncated {self.truncated} over --max-length; "
            if self.dropped or self.truncated
            else ""
        )
        return (
            f"packed {self.samples} samples ({self.bytes / 1e6:.1f} MB) into {self.shards} shards in "
            f"{self.seconds:.2f} s ({rate:,.0f} samples/s, {mbs:.1f} MB/s); skipped {_skips(self.skipped)}; "
            f"{capped}{what} at {self.out}"
        )

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _skips(skipped: list[str]) -> str:
    """The skips as the summary counts them: samples, and entries whose loss is unknown."""
    n, unknown = skipped_samples(skipped)
    return f"{n}" + (f" ({unknown} of them a source broken off, its size unknown)" if unknown else "")


def length_definition(fields: list[FieldSpec], length_field: str | None, length_fn: str | None) -> dict:
    if length_field is not None:
        spec = next(f for f in fields if f.name == length_field)
        unit = {"array": "elements", "text": "characters", "int": "value"}.get(spec.storage, "len")
        return {"field": length_field, "unit": unit, "fn": None}
    if length_fn is not None:
        return {"field": None, "unit": "fn", "fn": length_fn}
    return {"field": None, "unit": "bytes", "fn": None}


def publish_pack(
    out: str,
    fmt: str,
    fields: list[FieldSpec],
    length_def: dict,
    results: list[JobResult],
    skipped: list[str],
    T: int,
    I: int,
    max_skip_fraction: float | None,
    compression: str | None,
    extra: dict | None = None,
    inputs: dict | None = None,
    array: tuple[int, int] | None = None,
) -> PackResult:
    """Check the workers' results and publish the manifest (or this task's fragment), last."""
    results.sort(key=lambda r: r.worker)
    check_unique_keys(results)
    shards = [ShardInfo.from_dict(s, i) for i, s in enumerate(s for r in results for s in r.shards)]
    lengths = np.concatenate([l for r in results for l in r.lengths]) if shards else np.zeros(0, np.int64)
    for r in results:
        skipped.extend(r.skipped)
    n_samples = int(lengths.size)
    result = PackResult(
        out,
        n_samples,
        sum(s.bytes for s in shards),
        len(shards),
        0.0,
        skipped,
        task=I,
        num_tasks=T,
        array=array,
        dropped=sum(r.dropped for r in results),
        truncated=sum(r.truncated for r in results),
    )
    result.warnings = check_skips(skipped, n_samples, max_skip_fraction)
    keep = {p for s in shards for p in (s.path, s.index)}
    if T == 1:
        if n_samples == 0:
            why = [f"{len(skipped)} skipped"] if skipped else []
            why += [f"{result.dropped} dropped by --max-length"] if result.dropped else []
            raise ShardtoolError("no samples were packed" + (f" ({', '.join(why)})" if why else ""))
        outdir.remove_orphans(out, keep)
        publish_manifest(
            out, Manifest(fmt, fields, shards, length_def, extra=dict(extra or {}), compression=compression), lengths
        )
        result.manifest = os.path.join(out, "index.json")
    else:
        outdir.remove_orphans(out, keep, task=I)
        body = {
            "shardtool": "task-fragment",
            "task": I,
            "num_tasks": T,
            "shard_format": fmt,
            **({"compression": compression} if compression else {}),
            **({"extra": extra} if extra else {}),
            **({"inputs": inputs} if inputs else {}),
            "fields": [f.to_dict() for f in fields],
            "length": length_def,
            "shards": [s.to_dict() for s in shards],
            "skipped": skipped,
            "dropped": result.dropped,
            "truncated": result.truncated,
        }
        result.fragment = outdir.write_fragment(out, I, T, body, lengths, array)
    return result


def check_unique_keys(results: list[JobResult]) -> None:
    """Keys must be unique across the whole pack: one vectorised count, names only on failure.
    (Each worker refuses a key it already packed; this also catches keys of different workers,
    and a position key equal to a key taken from the data.)"""
    import pyarrow as pa
    import pyarrow.compute as pc

    arrays = [k for r in results for k in r.keys]
    if not arrays:
        return
    every = pa.chunked_array(arrays, type=pa.string())
    if pc.count_distinct(every).as_py() == len(every):
        return
    owner: dict[str, str] = {}
    for r in results:
        for shard, keys in zip(r.shards, r.keys):
            for k in keys.to_pylist():
                if k in owner:
                    raise BadSampleError(
                        f"duplicate key {k!r} (packed in {owner[k]} and {shard['path']})", source=shard["path"]
                    )
                owner[k] = shard["path"]
