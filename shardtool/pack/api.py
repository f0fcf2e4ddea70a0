"""``shardtool.pack(...)``: sources → shards + manifest (or a task fragment in a job array)."""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from ..format.errors import BadSampleError, ShardtoolError
from ..format.fields import FieldSpec
from ..format.manifest import Manifest, ShardInfo
from ..format.sizes import parse_size
from ..format.writer import publish_manifest
from ..plan.env import array_task
from . import outdir
from .options import load_function, strip_file_scheme
from .procs import run_jobs
from .progress import Progress
from .readers import Bad, count_unit, read_unit
from .schema import check_length_option, check_max_length_option, infer_fields
from .skips import PackWarning, check_fraction_option, check_skips
from .units import Unit, discover, positions, split_contiguous
from .worker import Job, JobResult

DEFAULT_SHARD_SIZE = 256 << 20
DEFAULT_MAX_SAMPLE_BYTES = 256 << 20


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
    dropped: int = 0  # longer than --max-length, dropped
    truncated: int = 0  # longer than --max-length, cut to it
    warnings: list[str] = field(default_factory=list)

    def summary(self) -> str:
        rate = self.samples / self.seconds if self.seconds > 0 else 0.0
        mbs = self.bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0
        what = "dataset" if self.manifest else f"task {self.task}/{self.num_tasks} fragment"
        capped = (f"dropped {self.dropped} and truncated {self.truncated} over --max-length; "
                  if self.dropped or self.truncated else "")
        return (f"packed {self.samples} samples ({self.bytes / 1e6:.1f} MB) into {self.shards} shards in "
                f"{self.seconds:.2f} s ({rate:,.0f} samples/s, {mbs:.1f} MB/s); skipped {len(self.skipped)}; "
                f"{capped}{what} at {self.out}")

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def length_definition(fields: list[FieldSpec], length_field: str | None, length_fn: str | None) -> dict:
    if length_field is not None:
        spec = next(f for f in fields if f.name == length_field)
        unit = {"array": "elements", "text": "characters", "int": "value"}.get(spec.storage, "len")
        return {"field": length_field, "unit": unit, "fn": None}
    if length_fn is not None:
        return {"field": None, "unit": "fn", "fn": length_fn}
    return {"field": None, "unit": "bytes", "fn": None}


def _first_sample_fields(units: list[Unit], *, max_sample_bytes, skip_bad) -> list[FieldSpec]:
    def on_bad(err):
        if not skip_bad:
            raise err

    for unit in units:
        try:
            for rec in read_unit(unit, max_sample_bytes=max_sample_bytes, on_bad=on_bad):
                if rec.__class__ is Bad:
                    on_bad(rec.error)
                    continue
                _, _, obj, where = rec
                return infer_fields(unit.kind, obj, source=unit.path, where=where)
        except BadSampleError as e:
            on_bad(e)
    raise ShardtoolError("no samples found in the sources" if units else "no sources to pack")


def _counted(units: list[Unit], *, skip_bad: bool, skipped: list[str]) -> list[Unit]:
    """Running-position keys need every structured unit's count, in every task alike."""
    counted = []
    for u in units:
        if u.structured and u.count < 0:
            try:
                u = Unit(u.kind, u.path, u.start, u.stop, count_unit(u), u.first_line, u.weight, u.members)
            except BadSampleError as e:
                if not skip_bad:
                    raise
                skipped.append(str(e))
                continue
        counted.append(u)
    return counted


def pack(
    sources: str | Sequence[str],
    out: str,
    *,
    format: str = "tar",
    key: str | None = None,
    length: str | None = None,
    length_fn: str | None = None,
    shard_size: int | str | None = None,
    samples_per_shard: int | None = None,
    workers: int = 1,
    num_tasks: int | None = None,
    task_index: int | None = None,
    skip_bad: bool = False,
    overwrite: bool = False,
    quiet: bool = True,
    max_sample_bytes: int | str | None = None,
    env: Mapping[str, str] | None = None,
    per_file: bool = False,
    max_length: int | None = None,
    max_length_policy: str = "drop",
    max_skip_fraction: float | None = None,
) -> PackResult:
    """Pack ``sources`` (directories of files, JSONL, Parquet, Arrow, WebDataset tars) into ``out``.

    Keyword options mirror ``shardtool pack`` (see ``shardtool pack --help``). The set of samples
    does not depend on ``workers`` or ``num_tasks``; for fixed values the output is byte-identical
    run to run. With ``num_tasks > 1`` (or ``SLURM_ARRAY_TASK_COUNT`` set) this packs task
    ``task_index``'s slice and writes a fragment; ``merge(out)`` (``from shardtool.pack import
    merge``) then writes the manifest.

    ``per_file=True`` packs every file of a directory source as one sample with fields ``bin``
    (its bytes) and ``path`` (its path relative to the directory), keyed by that path made safe.
    ``max_length`` drops samples longer than it (``max_length_policy="drop"``) or cuts the
    ``length`` field's 1-D array to it (``"truncate"``); both are counted in the result.
    ``max_skip_fraction`` implies ``skip_bad`` and fails the pack, publishing nothing, when more
    than that fraction of the samples was skipped.

    Raises :class:`BadSampleError` naming the file and position of bad input (unless
    ``skip_bad``, which counts and lists it) and :class:`ShardtoolError` for bad options. A
    failed pack removes the shards and directories it created.
    """
    if format not in ("tar", "arrow"):
        raise ShardtoolError(f"--format must be tar or arrow, got {format!r}")
    if length is not None and length_fn is not None:
        raise ShardtoolError("give --length or --length-fn, not both")
    if length_fn is not None:
        load_function(length_fn)  # fail early, in the parent, with a clear message
    if isinstance(sources, str):
        sources = [sources]
    if not sources:
        raise ShardtoolError("no sources given")
    if workers < 1:
        raise ShardtoolError(f"--workers must be ≥ 1, got {workers}")
    shard_size = parse_size(shard_size, what="--shard-size", positive=True)
    if samples_per_shard is not None and samples_per_shard < 1:
        raise ShardtoolError("--samples-per-shard must be ≥ 1")
    if shard_size is None and samples_per_shard is None:
        shard_size = DEFAULT_SHARD_SIZE
    max_sample_bytes = parse_size(max_sample_bytes, what="--max-sample-bytes", positive=True) or DEFAULT_MAX_SAMPLE_BYTES
    max_skip_fraction = check_fraction_option(max_skip_fraction)
    skip_bad = skip_bad or max_skip_fraction is not None
    T, I = array_task(num_tasks, task_index, env=os.environ if env is None else env)
    out = strip_file_scheme(out)
    if "://" in out:
        raise ShardtoolError(f"output {out!r}: pack writes to a local or mounted path (copy it to object storage after)")

    skipped: list[str] = []
    units = discover(list(sources), skip_bad=skip_bad, skipped=skipped, per_file=per_file)
    if not units:
        raise ShardtoolError("no samples found in the sources: " + ", ".join(sources)
                             + (f" ({len(skipped)} skipped; first: {skipped[0]})" if skipped else ""))
    fields = _first_sample_fields(units, max_sample_bytes=max_sample_bytes, skip_bad=skip_bad)
    check_length_option(fields, length)
    truncate = check_max_length_option(fields, length, max_length, max_length_policy)
    if key is not None and any(u.kind in ("tree", "files", "tar") for u in units):
        raise ShardtoolError("--key applies to JSONL/Parquet/Arrow sources; file trees and tars take keys from names")

    units = _counted(units, skip_bad=skip_bad, skipped=skipped)
    pos = positions(units)
    key_width = max(9, len(str(max(pos[-1] - 1, 0))))

    t0, t1 = split_contiguous([u.weight for u in units], T)[I]
    my_units, my_pos = units[t0:t1], pos[t0:t1]
    jobs = []
    for w, (a, b) in enumerate(split_contiguous([u.weight for u in my_units], workers)):
        jobs.append(Job(out=out, fmt=format, fields=fields, units=my_units[a:b], positions=my_pos[a:b], task=I,
                        worker=w, key_field=key, length_field=length, length_fn=length_fn, key_width=key_width,
                        shard_size=shard_size, samples_per_shard=samples_per_shard, skip_bad=skip_bad,
                        max_sample_bytes=max_sample_bytes, max_length=max_length, truncate=truncate))
    before = outdir.snapshot(out)
    outdir.prepare(out, task=I, num_tasks=T, overwrite=overwrite)

    total = sum(u.count for u in my_units) if all(u.count >= 0 for u in my_units) else None
    bar = Progress(total=total, quiet=quiet)
    try:
        try:
            results = run_jobs(jobs, bar)
        finally:
            bar.close()
        result = _publish(out, format, fields, length_definition(fields, length, length_fn), results, skipped,
                          T, I, max_skip_fraction)
    except BaseException:
        outdir.undo(out, before, task=I, num_tasks=T)  # a killed or failed worker cannot clean up its own
        raise
    result.seconds = bar.elapsed
    for text in result.warnings:
        warnings.warn(text, PackWarning, stacklevel=2)
    return result


def _publish(out: str, fmt: str, fields: list[FieldSpec], length_def: dict, results: list[JobResult],
             skipped: list[str], T: int, I: int, max_skip_fraction: float | None) -> PackResult:
    """Check the workers' results and publish the manifest (or this task's fragment), last."""
    results.sort(key=lambda r: r.worker)
    _check_unique_keys(results)
    shards = [ShardInfo.from_dict(s, i) for i, s in enumerate(s for r in results for s in r.shards)]
    lengths = np.concatenate([l for r in results for l in r.lengths]) if shards else np.zeros(0, np.int64)
    for r in results:
        skipped.extend(r.skipped)
    n_samples = int(lengths.size)
    result = PackResult(out, n_samples, sum(s.bytes for s in shards), len(shards), 0.0, skipped, task=I,
                        num_tasks=T, dropped=sum(r.dropped for r in results),
                        truncated=sum(r.truncated for r in results))
    result.warnings = check_skips(skipped, n_samples, max_skip_fraction)
    keep = {p for s in shards for p in (s.path, s.index)}
    if T == 1:
        if n_samples == 0:
            why = [f"{len(skipped)} skipped"] if skipped else []
            why += [f"{result.dropped} dropped by --max-length"] if result.dropped else []
            raise ShardtoolError("no samples were packed" + (f" ({', '.join(why)})" if why else ""))
        outdir.remove_orphans(out, keep)
        publish_manifest(out, Manifest(fmt, fields, shards, length_def), lengths)
        result.manifest = os.path.join(out, "index.json")
    else:
        outdir.remove_orphans(out, keep, task=I)
        body = {"shardtool": "task-fragment", "task": I, "num_tasks": T, "shard_format": fmt,
                "fields": [f.to_dict() for f in fields], "length": length_def,
                "shards": [s.to_dict() for s in shards], "skipped": skipped,
                "dropped": result.dropped, "truncated": result.truncated}
        result.fragment = outdir.write_fragment(out, I, T, body, lengths)
    return result


def _check_unique_keys(results: list[JobResult]) -> None:
    if len(results) < 2:
        return
    owner: dict[str, int] = {}
    for r in results:
        for shard, keys in zip(r.shards, r.keys):
            for k in keys:
                prev = owner.setdefault(k, r.worker)
                if prev != r.worker:
                    raise BadSampleError(f"duplicate key {k!r} (packed by workers {prev} and {r.worker})",
                                         source=shard["path"])
