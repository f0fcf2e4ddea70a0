"""``shardtool index TARS... -o DATASET``: index existing WebDataset tars where they are.

Writes only our metadata (manifest, per-shard sample indexes, ``lengths.npy``, summaries); the
tars are neither copied nor changed. Each manifest entry names its tar by a path relative to the
dataset (``../tars/x.tar``) or by URL (``ShardInfo.source``) and records its whole-file hash, so a
tar changed after indexing is refused at warm (the cache copy's hash) and at read (the sample
checksums, the loader's shard hash). Shard ``n`` of the collection is called
``shards/NNNNNN.tar`` in the dataset and in every cache.

Every tar is scanned once (:mod:`.tarscan`), by ``workers`` processes; a job array splits the
tars by task (``--num-tasks``) and ``shardtool merge`` writes the manifest, as for ``pack``.
Nothing is published until every tar is indexed; a bad tar is an error naming it and its
member, or, with ``skip_bad``, left out and listed.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from ..format.atomic import atomic_write_bytes
from ..format.errors import BadSampleError, ShardtoolError
from ..format.fields import FieldSpec
from ..format.hashing import hash_bytes
from ..format.manifest import Manifest, ShardInfo
from ..format.sindex import ShardIndex
from ..format.sizes import parse_size
from ..format.writer import publish_manifest
from ..plan.env import array_ids, array_task
from . import outdir
from .options import load_function, strip_file_scheme
from .skips import skip_entry
from .tarscan import LengthRule, TarScan, scan_tar
from .units import split_contiguous

DEFAULT_MAX_MEMBER_BYTES = 256 << 20
INDEX_RE = re.compile(r"\d{6}\.idx\.arrow$")


@dataclass
class IndexResult:
    out: str
    tars: int
    samples: int
    bytes: int
    seconds: float
    skipped: list[str] = field(default_factory=list)
    manifest: str | None = None
    fragment: str | None = None
    task: int = 0
    num_tasks: int = 1
    array: tuple[int, int] | None = None  # (first id, step) of the SLURM array the task ran in

    def summary(self) -> str:
        what = "dataset" if self.manifest else f"{outdir.task_words(self.task, self.num_tasks, self.array)} fragment"
        mbs = self.bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0
        return (
            f"indexed {self.samples} samples in {self.tars} tars ({self.bytes / 1e6:.1f} MB, left in place) in "
            f"{self.seconds:.2f} s ({mbs:.0f} MB/s); skipped {len(self.skipped)}; {what} at {self.out}"
        )

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def expand_tars(tars: Iterable[str | os.PathLike[str]]) -> list[str]:
    """TARS as given: a URL stays a URL; a glob expands (sorted); a directory gives its ``*.tar``
    files, recursively, sorted."""
    out: list[str] = []
    for given in tars:
        t = os.fspath(given)
        if "://" in t and not t.startswith("file://"):
            out.append(t)
            continue
        t = strip_file_scheme(t)
        if os.path.isdir(t):
            out.extend(sorted(glob.glob(os.path.join(t, "**", "*.tar"), recursive=True)))
        elif any(c in t for c in "*?[") and not os.path.exists(t):
            out.extend(sorted(glob.glob(t)) or [t])
        else:
            out.append(t)
    return out


def source_of(tar: str, out: str) -> str:
    """How the manifest names ``tar``: its URL, or its path relative to the dataset ``out``."""
    if "://" in tar:
        return tar
    return os.path.relpath(os.path.abspath(tar), os.path.abspath(out)).replace(os.sep, "/")


def _size(tar: str) -> int:
    try:
        return os.path.getsize(tar) if "://" not in tar else 1
    except OSError:
        return 1


# ------------------------------------------------------------------ one tar, in a worker
_LENGTH: LengthRule | None = None


def _init(length: str | None, length_fn: str | None) -> None:
    global _LENGTH
    _LENGTH = LengthRule.parse(length, load_function(length_fn) if length_fn else None)


def _scan_one(args: tuple) -> tuple:
    """(n, TarScan, index bytes) or (n, BadSampleError, None)."""
    n, tar, source, max_member = args
    length = _LENGTH
    if length is None:
        raise RuntimeError("tar scanned before _init set the length rule")
    fs = path = None
    try:
        if "://" in tar:
            from ..format.storage import dataset_fs

            fs, path = dataset_fs(tar)
        scan = scan_tar(path or tar, source=tar, max_member_bytes=max_member, length=length, fs=fs)
        if not scan.keys:
            raise BadSampleError("tar holds no samples", source=tar)
    except BadSampleError as e:
        return n, e, None
    count = len(scan.keys)
    idx = ShardIndex(
        pa.array(scan.keys, type=pa.string()),
        np.array(scan.offsets, dtype=np.uint64),
        np.array(scan.sizes, dtype=np.uint64),
        np.array(scan.lengths, dtype=np.int64),
    )
    idx.field_offsets = np.array(scan.field_offsets, dtype=np.uint32).reshape(count, len(scan.exts))
    idx.field_sizes = np.array(scan.field_sizes, dtype=np.uint64).reshape(count, len(scan.exts))
    idx.checksums = np.array(scan.checksums, dtype=np.uint64)
    return n, scan, idx.to_bytes(scan.exts)


def _scan_all(work: list[tuple], workers: int, length: str | None, length_fn: str | None) -> list[tuple]:
    if workers == 1 or len(work) <= 1:
        _init(length, length_fn)
        return [_scan_one(w) for w in work]
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context("spawn")
    # A worker killed mid-scan (OOM) fails the whole run with BrokenProcessPool, never a hang.
    with ProcessPoolExecutor(
        min(workers, len(work)), mp_context=ctx, initializer=_init, initargs=(length, length_fn)
    ) as pool:
        return list(pool.map(_scan_one, work, chunksize=1))


# ------------------------------------------------------------------ the collection
def index_tars(
    tars,
    out: str,
    *,
    length: str | None = None,
    length_fn: str | None = None,
    workers: int = 1,
    skip_bad: bool = False,
    overwrite: bool = False,
    max_member_bytes: int | str | None = None,
    num_tasks: int | None = None,
    task_index: int | None = None,
    env: Mapping[str, str] | None = None,
) -> IndexResult:
    """Index WebDataset ``tars`` (paths, globs, directories or URLs) in place into dataset ``out``.

    ``length``: the sample length, as pack's ``--length`` reads a field (``txt`` → characters,
    ``npy`` → elements, ``cls`` → its value), or ``FIELD:KEY`` for one key of a JSON member
    (``json:num_tokens``); ``length_fn``: ``module:function`` of the sample dict (fields as bytes);
    neither: payload bytes. Raises :class:`BadSampleError` naming the tar (and member) of bad
    input unless ``skip_bad``; nothing is published on failure.
    """
    t0 = time.perf_counter()
    if length is not None and length_fn is not None:
        raise ShardtoolError("give --length-field or --length-fn, not both")
    if length_fn is not None:
        load_function(length_fn)
    if workers < 1:
        raise ShardtoolError(f"--workers must be ≥ 1, got {workers}")
    max_member = parse_size(max_member_bytes, what="--max-member-bytes", positive=True) or DEFAULT_MAX_MEMBER_BYTES
    out = strip_file_scheme(os.fspath(out))
    if "://" in out:
        raise ShardtoolError(f"output {out!r}: index writes to a local or mounted path (the tars may be remote)")
    all_tars = expand_tars([tars] if isinstance(tars, (str, os.PathLike)) else list(tars))
    if not all_tars:
        raise ShardtoolError("no tars given")
    T, I = array_task(num_tasks, task_index, env=os.environ if env is None else env)
    array = array_ids(T, task_index, env=os.environ if env is None else env)
    a, b = split_contiguous([_size(t) for t in all_tars], T)[I]
    work = [(n, all_tars[n], source_of(all_tars[n], out), max_member) for n in range(a, b)]
    before = outdir.snapshot(out)
    outdir.prepare(out, task=I, num_tasks=T, overwrite=overwrite)
    try:
        scans = _scan_all(work, workers, length, length_fn)
        result = _publish(out, work, scans, length, length_fn, skip_bad, T, I, array)
    except BaseException:
        outdir.undo(out, before, task=I, num_tasks=T)
        raise
    result.seconds = time.perf_counter() - t0
    return result


def _length_def(fields: list[FieldSpec], length: str | None, length_fn: str | None) -> dict:
    from .publish import length_definition

    if length is not None and ":" in length:
        return {"field": None, "unit": "value", "fn": None, "json": length}
    if length is not None and length not in [f.name for f in fields]:
        raise ShardtoolError(
            f"--length-field {length!r} is not a field of the tars (fields: {', '.join(f.name for f in fields)})"
        )
    return length_definition(fields, length, length_fn)


def _publish(
    out: str,
    work: list[tuple],
    scans: list[tuple],
    length,
    length_fn,
    skip_bad: bool,
    T: int,
    I: int,
    array: tuple[int, int] | None = None,
) -> IndexResult:
    skipped: list[str] = []

    def bad(err: BadSampleError) -> None:
        if not skip_bad:
            raise err
        skipped.append(skip_entry(err))

    exts: list[str] | None = None
    owner: dict[str, str] = {}
    good: list[tuple[int, str, str, TarScan, bytes]] = []
    for (n, tar, source, _), (_, scanned, index_bytes) in zip(work, scans):
        if isinstance(scanned, BadSampleError):
            bad(scanned)
            continue
        scan: TarScan = scanned
        if exts is None:
            exts = scan.exts
        elif scan.exts != exts:
            bad(BadSampleError(f"samples have fields {scan.exts}, those of {good[0][1]} have {exts}", source=tar))
            continue
        dup = next((k for k in scan.keys if k in owner), None)
        if dup is not None:
            bad(BadSampleError(f"duplicate key {dup!r} (also in {owner[dup]})", source=tar))
            continue
        owner.update(dict.fromkeys(scan.keys, tar))
        good.append((n, tar, source, scan, index_bytes))
    if not good:
        raise ShardtoolError(
            "no tar was indexed" + (f" ({len(skipped)} skipped; first: {skipped[0]})" if skipped else "")
        )
    fields = [FieldSpec.raw(e) for e in good[0][3].exts]  # every good tar's fields match the first's
    length_def = _length_def(fields, length, length_fn)
    shards, lengths, written = [], [], []
    try:
        for n, tar, source, scan, index_bytes in good:
            rel, index_rel = f"shards/{n:06d}.tar", f"shards/{n:06d}.idx.arrow"
            atomic_write_bytes(os.path.join(out, index_rel), index_bytes)
            written.append(os.path.join(out, index_rel))
            shards.append(
                ShardInfo(
                    rel,
                    len(scan.keys),
                    scan.bytes,
                    scan.hash,
                    index_rel,
                    len(index_bytes),
                    hash_bytes(index_bytes),
                    source=source,
                )
            )
            lengths.append(np.array(scan.lengths, dtype=np.int64))
        return _commit(out, fields, length_def, shards, lengths, skipped, T, I, array)
    except BaseException:
        for path in written:  # no manifest will name them
            with contextlib.suppress(OSError):
                os.unlink(path)
        raise


def _commit(
    out: str, fields, length_def, shards, lengths, skipped, T: int, I: int, array: tuple[int, int] | None = None
) -> IndexResult:
    all_lengths = np.concatenate(lengths)
    result = IndexResult(
        out,
        len(shards),
        int(all_lengths.size),
        sum(s.bytes for s in shards),
        0.0,
        skipped,
        task=I,
        num_tasks=T,
        array=array,
    )
    if T == 1:
        keep = {os.path.basename(s.index) for s in shards}
        for name in os.listdir(os.path.join(out, "shards")):  # indexes of an earlier run's other tars
            if INDEX_RE.match(name) and name not in keep:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(out, "shards", name))
        publish_manifest(out, Manifest("tar", fields, shards, length_def), all_lengths)
        result.manifest = os.path.join(out, "index.json")
    else:
        body = {
            "shardtool": "task-fragment",
            "task": I,
            "num_tasks": T,
            "shard_format": "tar",
            "fields": [f.to_dict() for f in fields],
            "length": length_def,
            "shards": [s.to_dict() for s in shards],
            "skipped": skipped,
            "dropped": 0,
            "truncated": 0,
        }
        result.fragment = outdir.write_fragment(out, I, T, body, all_lengths, array)
    return result
