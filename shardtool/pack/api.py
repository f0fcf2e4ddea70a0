"""``shardtool.pack(...)``: sources → shards + manifest (or a task fragment in a job array)."""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..format.errors import BadSampleError, ShardtoolError
from ..format.fields import FieldSpec
from ..format.manifest import COMPRESSIONS, Manifest, ShardInfo
from ..format.sizes import parse_size
from ..format.writer import publish_manifest
from ..plan.env import array_task
from . import outdir
from .foreign import default_length
from .options import load_function, strip_file_scheme
from .procs import run_jobs
from .progress import Progress
from .readers import Bad, count_unit, read_unit
from .schema import check_length_option, check_max_length_option, infer_fields
from .skips import PackWarning, check_fraction_option, check_skips
from .sources import classify, memory_units
from .tokenize import TOKENS_FIELD, Tokenize, tokenized_fields
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
        capped = (
            f"dropped {self.dropped} and truncated {self.truncated} over --max-length; "
            if self.dropped or self.truncated
            else ""
        )
        return (
            f"packed {self.samples} samples ({self.bytes / 1e6:.1f} MB) into {self.shards} shards in "
            f"{self.seconds:.2f} s ({rate:,.0f} samples/s, {mbs:.1f} MB/s); skipped {len(self.skipped)}; "
            f"{capped}{what} at {self.out}"
        )

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


def _first_sample_fields(units: list[Unit], *, max_sample_bytes, skip_bad, key_field) -> list[FieldSpec]:
    def on_bad(err):
        if not skip_bad:
            raise err

    for unit in units:
        try:
            records = (
                read_unit(unit, max_sample_bytes=max_sample_bytes, on_bad=on_bad)
                if not unit.stream
                else _peek_stream(unit)
            )
            for rec in records:
                if rec.__class__ is Bad:
                    on_bad(rec.error)
                    continue
                _, _, obj, where = rec
                return infer_fields(unit.kind, obj, source=unit.path, where=where, key_field=key_field)
        except BadSampleError as e:
            on_bad(e)
    raise ShardtoolError("no samples found in the sources" if units else "no sources to pack")


def _peek_stream(unit: Unit):
    """The first records of a stream; the stream keeps what is read, to replay it when packing."""
    from .readers import batch_rows

    if unit.obj.items == "dicts":
        for i, obj in enumerate(unit.obj.peek()):
            yield i, None, obj, f"row {i}"
        return
    for batch in unit.obj.peek():
        yield from batch_rows(unit, batch, 0)


def _counted(units: list[Unit], *, skip_bad: bool, skipped: list[str]) -> list[Unit]:
    """Running-position keys need every structured unit's count, in every task alike."""
    counted = []
    for u in units:
        if u.structured and u.count < 0 and not u.stream:
            try:
                u = dataclasses.replace(u, count=count_unit(u))
            except BadSampleError as e:
                if not skip_bad:
                    raise
                skipped.append(str(e))
                continue
        counted.append(u)
    return counted


def _units(
    sources: list, *, skip_bad: bool, skipped: list[str], per_file: bool, label_from_dir: bool = False
) -> list[Unit]:
    """Units of paths and in-memory sources, in the order given."""
    units: list[Unit] = []
    paths: list[str] = []
    for i, src in enumerate(sources):
        if isinstance(src, str):
            paths.append(src)
            continue
        if label_from_dir:
            raise ShardtoolError(
                f"label_from_dir reads directories (ROOT/CLASS/FILE); source #{i} is a {type(src).__name__}"
            )
        units.extend(discover(paths, skip_bad=skip_bad, skipped=skipped, per_file=per_file))
        paths = []
        units.extend(memory_units(src, i, len(sources)))
    units.extend(discover(paths, skip_bad=skip_bad, skipped=skipped, per_file=per_file, label_from_dir=label_from_dir))
    return units


def _classes(units: list[Unit]) -> dict:
    """The manifest's ``extra`` of an ImageFolder pack: its class names in label order. Several
    trees are one dataset only when their classes are the same, so that a label means one class."""
    trees = {u.path: u.obj for u in units if u.kind == "images"}
    if not trees:
        return {}
    first_path, classes = next(iter(trees.items()))
    for path, other in trees.items():
        if other != classes:
            raise ShardtoolError(
                f"--label-from-dir: {path} has classes {list(other)[:8]}, {first_path} has "
                f"{list(classes)[:8]}; labels would mean different classes (pack them separately)"
            )
    return {"classes": list(classes)}


def _check_options(
    format: str,
    length: str | None,
    length_fn: str | None,
    workers: int,
    compression: str | None,
    tokenizer,
    text_field: str | None,
) -> str | None:
    """Refuse inconsistent options before anything is read; returns the compression (or None)."""
    if format not in ("tar", "arrow"):
        raise ShardtoolError(f"--format must be tar or arrow, got {format!r}")
    if length is not None and length_fn is not None:
        raise ShardtoolError("give --length or --length-fn, not both")
    if length_fn is not None:
        load_function(length_fn)  # fail early, in the parent, with a clear message
    if workers < 1:
        raise ShardtoolError(f"--workers must be ≥ 1, got {workers}")
    if compression in (None, "none"):
        compression = None
    elif compression not in COMPRESSIONS:
        raise ShardtoolError(f"--compression must be one of {', '.join(COMPRESSIONS)} or none, got {compression!r}")
    elif format != "arrow":
        raise ShardtoolError(
            "--compression applies to Arrow shards (--format arrow): tar shards stay plain "
            "WebDataset tars, which webdataset and tar read unmodified"
        )
    if (tokenizer is None) != (text_field is None):
        raise ShardtoolError("--tokenizer and --text-field go together (the text field is what gets tokenized)")
    if tokenizer is not None and (length_fn is not None or length not in (None, TOKENS_FIELD)):
        raise ShardtoolError(
            f"with --tokenizer the length is the token count (field {TOKENS_FIELD!r}); drop --length/--length-fn"
        )
    return compression


def pack(
    sources: Any,
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
    total: int | None = None,
    tokenizer: Any = None,
    text_field: str | None = None,
    eos_id: int | None = None,
    keep_text: bool = False,
    compression: str | None = None,
    label_from_dir: bool = False,
    record_batch_size: int | str | None = None,
) -> PackResult:
    """Pack ``sources`` into ``out``.

    ``sources``: a path or a list of paths (directories of files, JSONL, Parquet, Arrow,
    WebDataset tars); a ``pyarrow.Table``, ``RecordBatchReader`` or ``pyarrow.dataset.Dataset``; a
    Hugging Face ``datasets.Dataset`` or ``IterableDataset``; or an iterable of dicts (a list, a
    generator; ``total=`` tells the progress bar how many). Tables, datasets and lists are split by
    rows over ``workers``; a stream (generator, RecordBatchReader, IterableDataset) is read once,
    in order, by one process. Anything else is a TypeError listing what is accepted.

    Keyword options mirror ``shardtool pack`` (see ``shardtool pack --help``). The set of samples
    does not depend on ``workers`` or ``num_tasks``; for fixed values the output is byte-identical
    run to run, and the same rows give the same dataset from any kind of source. With
    ``num_tasks > 1`` (or ``SLURM_ARRAY_TASK_COUNT`` set) this packs task ``task_index``'s slice
    and writes a fragment; ``merge(out)`` (``from shardtool.pack import merge``) then writes the
    manifest.

    ``key``: the column holding each sample's key (it is the key, not also a field).
    ``tokenizer`` (a path to a ``tokenizer.json``, a ``tokenizers.Tokenizer`` or a ``transformers``
    fast tokenizer) with ``text_field``: the text becomes field ``tokens`` (token ids, uint16 when
    the vocabulary has at most 65,536 ids, else uint32; ``eos_id`` appended when given), which is
    the length field; ``keep_text`` keeps the text too. ``compression`` (``"zstd"`` or ``"lz4"``,
    Arrow shards only) compresses each record batch. ``record_batch_size`` (bytes or a size
    like ``"256KiB"``; Arrow shards only) is the payload at which a record batch is cut: by
    default 1 MiB, at most 256 rows for plain shards and 8,192 for compressed ones. A reader
    decompresses whole batches, each about once per pass; smaller batches cost less memory per
    process reading a compressed dataset in place and decompress slower.
    ``per_file=True`` packs every file of a directory source as one sample with fields ``bin``
    (its bytes) and ``path`` (its path relative to the directory), keyed by that path made safe.
    ``label_from_dir=True`` reads each directory as torchvision's ImageFolder does (``ROOT/CLASS/
    .../FILE.EXT``): one file = one sample keyed like ``per_file``, its bytes under its last
    extension lower-cased (``png``) and its class index under ``cls`` (WebDataset's integer
    label); the class names, sorted as torchvision's ``class_to_idx``, are recorded in the
    manifest (``Manifest.extra["classes"]``).
    ``max_length`` drops samples longer than it (``max_length_policy="drop"``) or cuts the
    ``length`` field's 1-D array to it (``"truncate"``); both are counted in the result.
    ``max_skip_fraction`` implies ``skip_bad`` and fails the pack, publishing nothing, when more
    than that fraction of the samples was skipped.

    Raises :class:`BadSampleError` naming the file (or source) and position of bad input (unless
    ``skip_bad``, which counts and lists it) and :class:`ShardtoolError` for bad options. A
    failed pack removes the shards and directories it created.
    """
    compression = _check_options(format, length, length_fn, workers, compression, tokenizer, text_field)
    sources = classify(sources)
    if not sources:
        raise ShardtoolError("no sources given")
    shard_size = parse_size(shard_size, what="--shard-size", positive=True)
    record_batch_size = parse_size(record_batch_size, what="--record-batch-size", positive=True)
    if record_batch_size is not None and format != "arrow":
        raise ShardtoolError("--record-batch-size applies to Arrow shards (--format arrow)")
    if samples_per_shard is not None and samples_per_shard < 1:
        raise ShardtoolError("--samples-per-shard must be ≥ 1")
    if shard_size is None and samples_per_shard is None:
        shard_size = DEFAULT_SHARD_SIZE
    max_sample_bytes = (
        parse_size(max_sample_bytes, what="--max-sample-bytes", positive=True) or DEFAULT_MAX_SAMPLE_BYTES
    )
    max_skip_fraction = check_fraction_option(max_skip_fraction)
    skip_bad = skip_bad or max_skip_fraction is not None
    T, I = array_task(num_tasks, task_index, env=os.environ if env is None else env)
    out = strip_file_scheme(out)
    if "://" in out:
        raise ShardtoolError(
            f"output {out!r}: pack writes to a local or mounted path (copy it to object storage after)"
        )

    skipped: list[str] = []
    if per_file and label_from_dir:
        raise ShardtoolError(
            "give --per-file or --label-from-dir, not both (--label-from-dir is one file per "
            "sample too, with a class label)"
        )
    units = _units(sources, skip_bad=skip_bad, skipped=skipped, per_file=per_file, label_from_dir=label_from_dir)
    if not units:
        raise ShardtoolError(
            "no samples found in the sources: "
            + ", ".join(map(str, sources))
            + (f" ({len(skipped)} skipped; first: {skipped[0]})" if skipped else "")
        )
    extra = _classes(units)
    if key is not None and any(u.kind in ("tree", "files", "images", "tar") for u in units):
        raise ShardtoolError("--key applies to JSONL/Parquet/Arrow sources; file trees and tars take keys from names")
    source_fields = _first_sample_fields(units, max_sample_bytes=max_sample_bytes, skip_bad=skip_bad, key_field=key)
    fields, tok = source_fields, None
    if length is None and length_fn is None and tokenizer is None:
        length = default_length(units)  # a Megatron dataset's documents are measured in tokens
    if tokenizer is not None:
        tok = Tokenize(tokenizer, text_field=text_field, eos_id=eos_id, keep_text=keep_text)
        fields = tokenized_fields(source_fields, text_field, keep_text, tok.dtype.str.lstrip("<>=|"))
        length = TOKENS_FIELD
    check_length_option(fields, length)
    truncate = check_max_length_option(fields, length, max_length, max_length_policy)
    if key is not None and key == length:
        raise ShardtoolError(f"--length {length!r} is the --key column, which is the key, not a field")

    units = _counted(units, skip_bad=skip_bad, skipped=skipped)
    streaming = any(u.stream for u in units)
    if streaming and T > 1:
        raise ShardtoolError(
            "a stream (a generator, RecordBatchReader or IterableDataset) is read once, by one "
            "process: it cannot be split over job-array tasks (pack it with num_tasks=1)"
        )
    pos = positions(units)
    count = total if streaming and total is not None else pos[-1]
    key_width = max(9, len(str(max(count - 1, 0))))

    t0, t1 = split_contiguous([u.weight for u in units], T)[I]
    my_units, my_pos = units[t0:t1], pos[t0:t1]
    jobs = []
    for w, (a, b) in enumerate(split_contiguous([u.weight for u in my_units], 1 if streaming else workers)):
        jobs.append(
            Job(
                out=out,
                fmt=format,
                fields=fields,
                units=my_units[a:b],
                positions=my_pos[a:b],
                task=I,
                worker=w,
                key_field=key,
                length_field=length,
                length_fn=length_fn,
                key_width=key_width,
                shard_size=shard_size,
                samples_per_shard=samples_per_shard,
                skip_bad=skip_bad,
                max_sample_bytes=max_sample_bytes,
                max_length=max_length,
                truncate=truncate,
                source_fields=source_fields,
                tokenize=tok,
                compression=compression,
                record_batch_size=record_batch_size,
                running_positions=streaming,
            )
        )
    before = outdir.snapshot(out)
    outdir.prepare(out, task=I, num_tasks=T, overwrite=overwrite)

    if total is None and all(u.count >= 0 for u in my_units):
        total = sum(u.count for u in my_units)
    bar = Progress(total=total, quiet=quiet)
    try:
        try:
            results = run_jobs(jobs, bar)
        finally:
            bar.close()
        length_def = length_definition(fields, length, length_fn)
        if tok is not None and tok.eos:
            length_def["eos_id"] = tok.eos[0]  # every document ends with it: a loader must not append another
        result = _publish(
            out, format, fields, length_def, results, skipped, T, I, max_skip_fraction, compression, extra
        )
    except BaseException:
        outdir.undo(out, before, task=I, num_tasks=T)  # a killed or failed worker cannot clean up its own
        raise
    result.seconds = bar.elapsed
    for text in result.warnings:
        warnings.warn(text, PackWarning, stacklevel=2)
    return result


def _publish(
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
) -> PackResult:
    """Check the workers' results and publish the manifest (or this task's fragment), last."""
    results.sort(key=lambda r: r.worker)
    _check_unique_keys(results)
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
            "fields": [f.to_dict() for f in fields],
            "length": length_def,
            "shards": [s.to_dict() for s in shards],
            "skipped": skipped,
            "dropped": result.dropped,
            "truncated": result.truncated,
        }
        result.fragment = outdir.write_fragment(out, I, T, body, lengths)
    return result


def _check_unique_keys(results: list[JobResult]) -> None:
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
