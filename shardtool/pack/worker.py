"""One worker: pack a contiguous run of units into its own shards, in unit order.

Shard names carry the task and worker number (``t0003-w01-000042.tar``), so workers and job
array tasks never collide, and for a fixed split the same input gives the same bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..format.errors import BadSampleError
from ..format.fields import FieldSpec
from ..format.tarshard import BLOCK
from ..format.writer import ShardFileWriter
from .options import load_function
from .fastcol import BatchEncoder, EncodedBatch
from .prefetch import prefetch
from .readers import Bad, ColumnBatch, batch_rows, read_unit
from .schema import Shaper
from .units import Unit

PROGRESS_EVERY = 1024


def shard_name(task: int, worker: int, seq: int, fmt: str) -> str:
    return f"shards/t{task:04d}-w{worker:02d}-{seq:06d}.{fmt}"


@dataclass
class Job:
    out: str
    fmt: str
    fields: list[FieldSpec]
    units: list[Unit]
    positions: list[int]  # first global sample position of each unit
    task: int
    worker: int
    key_field: str | None = None
    length_field: str | None = None
    length_fn: str | None = None
    key_width: int = 9
    shard_size: int | None = None
    samples_per_shard: int | None = None
    skip_bad: bool = False
    max_sample_bytes: int = 256 << 20
    max_length: int | None = None
    truncate: bool = False  # over max_length: cut the length field's array (else drop the sample)


@dataclass
class JobResult:
    task: int
    worker: int
    shards: list[dict] = field(default_factory=list)
    lengths: list[np.ndarray] = field(default_factory=list)
    keys: list[list[str]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    dropped: int = 0  # samples over --max-length, dropped
    truncated: int = 0  # samples over --max-length, cut to it


# A file tree whose samples disagree on their fields is usually a tree of unrelated files.
TREE_FIELDS_HINT = " (a file tree: pack with --per-file to make each file one sample)"


class _Roller:
    """Starts a new shard when the next sample would pass the size or count limit."""

    def __init__(self, job: Job, result: JobResult):
        self.job = job
        self.result = result
        self.seq = 0
        self.w: ShardFileWriter | None = None
        self.cur_bytes = 0

    def _open_next(self) -> None:
        job = self.job
        self.w = ShardFileWriter(job.out, shard_name(job.task, job.worker, self.seq, job.fmt), job.fmt, job.fields)
        self.seq += 1
        self.cur_bytes = 0

    def add(self, key, values, payloads, length, sample_bytes, source, where) -> None:
        job = self.job
        if job.shard_size is not None and sample_bytes > job.shard_size:
            raise BadSampleError(f"sample {key!r} is {sample_bytes} bytes, larger than the shard size "
                                 f"({job.shard_size} bytes)", source=source, position=where)
        if self.w is not None and (
            (job.samples_per_shard is not None and len(self.w.keys) >= job.samples_per_shard)
            or (job.shard_size is not None and self.cur_bytes + sample_bytes + 2 * BLOCK > job.shard_size)
        ):
            self.finish()
        if self.w is None:
            self._open_next()
        self.w.add_encoded(key, values, payloads, length)
        self.cur_bytes += sample_bytes

    def add_batch(self, enc: EncodedBatch) -> None:
        """Same shard cuts as calling :meth:`add` per sample, decided on the cumulative sizes."""
        job = self.job
        offsets = enc.offsets
        n = len(enc)
        i = 0
        while i < n:
            if self.w is None:
                self._open_next()
            have = len(self.w.keys)
            k = n - i
            if job.samples_per_shard is not None:
                k = min(k, job.samples_per_shard - have)
            if job.shard_size is not None and k > 0:
                # Sample i+m fits while cur + (offsets[i+m+1] - offsets[i]) + 2 blocks <= limit.
                room = job.shard_size - 2 * BLOCK - self.cur_bytes + int(offsets[i])
                k = min(k, int(np.searchsorted(offsets[i + 1 : i + 1 + k], room, side="right")))
            if k <= 0:
                if have == 0:
                    k = 1  # a fresh shard always takes the next sample
                else:
                    self.finish()
                    continue
            j = i + k
            a, b = int(offsets[i]), int(offsets[j])
            self.w.add_tar_block(memoryview(enc.data)[a:b], enc.keys[i:j], offsets[i : j + 1] - a,
                                 enc.field_offsets[i:j], enc.field_sizes[i:j], enc.lengths[i:j])
            self.cur_bytes += b - a
            i = j

    def finish(self) -> None:
        if self.w is None:
            return
        keys = self.w.keys
        info, lengths = self.w.finish()
        self.result.shards.append(info.to_dict())
        self.result.lengths.append(lengths)
        self.result.keys.append(keys)
        self.w = None

    def abort(self) -> None:
        if self.w is not None:
            self.w.abort()
            self.w = None


def run_job(job: Job, progress: Callable[[int, int], None] | None = None) -> JobResult:
    result = JobResult(job.task, job.worker)
    fn = load_function(job.length_fn) if job.length_fn else None
    shaper = Shaper(job.fields, key_field=job.key_field, length_field=job.length_field, length_fn=fn,
                    key_width=job.key_width, max_length=job.max_length, truncate=job.truncate)
    roller = _Roller(job, result)
    tar = job.fmt == "tar"
    pending_n = pending_b = 0
    seen: set[str] = set()
    nf_block = BLOCK * len(job.fields)

    def skip(err: BadSampleError) -> None:
        if not job.skip_bad:
            raise err
        result.skipped.append(str(err))

    # Whole Arrow batches go through the columnar fast path when keys are positions and the
    # length is a field (or bytes); it declines any batch it cannot encode exactly.
    fast = None
    if tar and job.key_field is None and job.length_fn is None:
        fast = BatchEncoder(job.fields, key_width=job.key_width, length_field=job.length_field,
                            shard_size=job.shard_size)
        if not fast.ok:
            fast = None

    def pack_batch(cb: ColumnBatch, pos0: int) -> bool:
        enc = fast.encode(cb.batch, pos0 + cb.pos)
        if enc is None or not seen.isdisjoint(enc.keys):
            return False
        if job.max_length is not None and len(enc) and int(enc.lengths.max()) > job.max_length:
            return False  # the row path drops or truncates the over-long samples
        roller.add_batch(enc)
        seen.update(enc.keys)
        if progress is not None:
            progress(len(enc), enc.payload_bytes)
        return True

    reading: list = []
    try:
        for unit, pos0 in zip(job.units, job.positions):
            shaper.field_hint = TREE_FIELDS_HINT if unit.kind == "tree" else ""
            try:
                recs_or_batches = read_unit(unit, max_sample_bytes=job.max_sample_bytes, on_bad=skip,
                                            whole_batches=fast is not None)
                if fast is not None and unit.kind in ("parquet", "arrow"):
                    recs_or_batches = prefetch(recs_or_batches)
                    reading.append(recs_or_batches)
                for batch_rec in recs_or_batches:
                    if batch_rec.__class__ is ColumnBatch:
                        if pack_batch(batch_rec, pos0):
                            continue
                        recs = batch_rows(unit, batch_rec.batch, batch_rec.pos)
                    else:
                        recs = (batch_rec,)
                    for rec in recs:
                        if rec.__class__ is Bad:
                            skip(rec.error)
                            continue
                        pos, key, obj, where = rec
                        try:
                            shaped = shaper.shape(pos0 + pos, key, obj, unit.path, where)
                            if shaped is None:
                                result.dropped += 1
                                continue
                            key, values, payloads, length, nbytes = shaped
                            if key in seen:
                                raise BadSampleError(f"duplicate key {key!r}", source=unit.path, position=where)
                            if tar:
                                sample_bytes = nbytes + nf_block
                                for p in payloads:
                                    sample_bytes += -len(p) % BLOCK
                            else:
                                sample_bytes = nbytes
                            roller.add(key, values, payloads, length, sample_bytes, unit.path, where)
                        except BadSampleError as e:
                            skip(e)
                            continue
                        seen.add(key)
                        result.truncated += shaper.was_truncated
                        pending_n += 1
                        pending_b += nbytes
                        if pending_n >= PROGRESS_EVERY and progress is not None:
                            progress(pending_n, pending_b)
                            pending_n = pending_b = 0
            except BadSampleError as e:  # the unit itself is unreadable past this point
                skip(e)
        roller.finish()
    except BaseException:
        for it in reading:  # stop read-ahead threads now, not when the traceback is freed
            it.close()
        roller.abort()
        raise
    if progress is not None and pending_n:
        progress(pending_n, pending_b)
    return result
