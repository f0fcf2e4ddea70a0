"""One worker: pack a contiguous run of units into its own shards, in unit order.

Shard names carry the task and worker number (``t0003-w01-000042.tar``), so workers and job
array tasks never collide, and for a fixed split the same input gives the same bytes.

Structured data goes through the columnar path as whole batches (Arrow record batches as read;
JSONL lines and dicts gathered into chunks): ``columns.ColumnShaper`` → tar members laid out by
``fastcol`` or record batches written as they are. A batch that path declines is packed sample
by sample (``schema.Shaper``), which also raises the errors naming the bad sample; both paths
write the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..format.errors import BadSampleError
from ..format.fields import FieldSpec
from ..format.tarshard import BLOCK
from .columns import ColumnShaper, ShardBatch, dicts_to_batch
from .fastcol import TarEncoder
from .options import load_function
from .prefetch import prefetch
from .readers import Bad, ColumnBatch, RowChunk, batch_rows, read_unit
from .roller import Roller, shard_name  # noqa: F401  (shard_name: re-exported for callers)
from .schema import Shaper
from .skips import skip_entry
from .tree import FLAGS_ADVICE
from .units import Unit

PROGRESS_EVERY = 1024


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
    source_fields: list[FieldSpec] | None = None  # the sources' fields, before tokenizing (default: fields)
    tokenize: Any = None  # a tokenize.Tokenize, or None
    compression: str | None = None  # arrow shards: zstd | lz4
    record_batch_size: int | None = None  # arrow shards: payload bytes a record batch is cut at
    running_positions: bool = False  # a stream is among the units: positions are counted as read


@dataclass
class JobResult:
    task: int
    worker: int
    shards: list[dict] = field(default_factory=list)
    lengths: list[np.ndarray] = field(default_factory=list)
    keys: list = field(default_factory=list)  # an Arrow string array per shard
    skipped: list[str] = field(default_factory=list)
    dropped: int = 0  # samples over --max-length, dropped
    truncated: int = 0  # samples over --max-length, cut to it


# A file tree whose samples disagree on their fields is usually a tree of unrelated files.
TREE_FIELDS_HINT = f" (a file tree: {FLAGS_ADVICE})"


class _Packer:
    def __init__(self, job: Job, result: JobResult, progress: Callable[[int, int], None] | None):
        self.job, self.result, self.progress = job, result, progress
        fn = load_function(job.length_fn) if job.length_fn else None
        self.shaper = Shaper(
            job.fields,
            key_field=job.key_field,
            length_field=job.length_field,
            length_fn=fn,
            key_width=job.key_width,
            max_length=job.max_length,
            truncate=job.truncate,
        )
        # A length function sees one sample at a time: no columnar path then.
        self.columns = (
            None
            if fn is not None
            else ColumnShaper(
                job.fields,
                key_field=job.key_field,
                length_field=job.length_field,
                key_width=job.key_width,
                max_length=job.max_length,
                truncate=job.truncate,
            )
        )
        self.tar = TarEncoder(job.fields, shard_size=job.shard_size) if job.fmt == "tar" else None
        self.source_fields = job.source_fields or job.fields
        self.roller = Roller(job, result)
        self.seen: set[str] = set()  # keys taken from the data (positions cannot repeat)
        self.pending_n = self.pending_b = 0
        self.nf_block = BLOCK * len(job.fields)

    def skip(self, err: BadSampleError) -> None:
        if not self.job.skip_bad:
            raise err
        self.result.skipped.append(skip_entry(err))

    # ------------------------------------------------------------------ whole batches
    def batch(self, unit: Unit, pos0: int, item) -> None:
        if item.__class__ is ColumnBatch:
            batch, json_as_text = item.batch, False
            positions = np.arange(pos0 + item.pos, pos0 + item.pos + batch.num_rows, dtype=np.int64)
            rows = lambda: batch_rows(unit, item.batch, item.pos)  # noqa: E731
        else:
            batch = dicts_to_batch([r[2] for r in item.records], self.source_fields, self.job.key_field)
            json_as_text = True
            positions = pos0 + np.array([r[0] for r in item.records], dtype=np.int64)
            rows = lambda: item.records  # noqa: E731
        if self.columns is not None and batch is not None:
            if self.job.tokenize is not None:
                batch = self.job.tokenize.batch(batch)
            sb = None if batch is None else self.columns.shape(batch, positions, json_as_text=json_as_text)
            if sb is not None and self._write(sb):
                self.result.dropped += self.columns.dropped
                return
        for rec in rows():
            self.row(unit, pos0, rec)

    def _write(self, sb: ShardBatch) -> bool:
        """Append a shard batch; False (nothing written) when the per-sample path must take it."""
        job = self.job
        if len(sb) == 0:
            return True
        if sb.keys_from_data:
            keys = sb.batch.column(0).to_pylist()
            if len(set(keys)) != len(keys) or not self.seen.isdisjoint(keys):
                return False  # the per-sample path names the duplicate
        if self.tar is not None:
            enc = self.tar.encode(sb)
            if enc is None:
                return False
            data = enc.data.data  # memoryview(enc.data): numpy's stubs give ndarray __buffer__ only from Python 3.12

            def put(w, i, j):
                a, b = int(enc.offsets[i]), int(enc.offsets[j])
                w.add_tar_block(
                    data[a:b],
                    enc.keys.slice(i, j - i),
                    enc.offsets[i : j + 1] - a,
                    enc.field_offsets[i:j],
                    enc.field_sizes[i:j],
                    enc.lengths[i:j],
                )

            self.roller.add_batch(enc.offsets, put)
            payload = enc.payload_bytes
        else:
            sample_bytes = sb.sizes.sum(axis=1)
            if job.shard_size is not None and int(sample_bytes.max()) > job.shard_size:
                return False  # the per-sample path reports it
            offsets = np.zeros(len(sb) + 1, dtype=np.int64)
            np.cumsum(sample_bytes, out=offsets[1:])

            def put(w, i, j):
                w.add_arrow_batch(sb.batch.slice(i, j - i), sb.lengths[i:j], sample_bytes[i:j])

            self.roller.add_batch(offsets, put)
            payload = int(offsets[-1])
        if sb.keys_from_data:
            self.seen.update(keys)
        if self.progress is not None:
            self.progress(len(sb), payload)
        return True

    # ------------------------------------------------------------------ one sample
    def row(self, unit: Unit, pos0: int, rec) -> None:
        if rec.__class__ is Bad:
            self.skip(rec.error)
            return
        job = self.job
        pos, key, obj, where = rec
        try:
            if job.tokenize is not None:  # tar members and files too (a .txt is text)
                obj = job.tokenize.row(obj, unit.path, where)
            shaped = self.shaper.shape(pos0 + pos, key, obj, unit.path, where)
            if shaped is None:
                self.result.dropped += 1
                return
            key, values, payloads, length, nbytes = shaped
            if self.shaper.key_from_data and key in self.seen:
                raise BadSampleError(f"duplicate key {key!r}", source=unit.path, position=where)
            sample_bytes = nbytes
            if self.tar is not None:
                sample_bytes += self.nf_block + sum(-len(p) % BLOCK for p in payloads)
            self.roller.add(key, values, payloads, length, sample_bytes, unit.path, where)
        except BadSampleError as e:
            self.skip(e)
            return
        if self.shaper.key_from_data:
            self.seen.add(key)
        self.result.truncated += self.shaper.was_truncated
        self.pending_n += 1
        self.pending_b += nbytes
        if self.pending_n >= PROGRESS_EVERY and self.progress is not None:
            self.progress(self.pending_n, self.pending_b)
            self.pending_n = self.pending_b = 0

    # ------------------------------------------------------------------ the job
    def _read_ahead(self):
        """(unit number, item) over all the job's Parquet/Arrow units in order, an unreadable unit's
        error in place of its remaining items: one read-ahead thread for the whole job, so the next
        unit decodes while this one is written (a unit is often one row group, one batch: read
        ahead within a unit alone would never overlap anything)."""
        for i, unit in enumerate(self.job.units):
            try:
                for item in read_unit(
                    unit, max_sample_bytes=self.job.max_sample_bytes, on_bad=self.skip, whole_batches=True
                ):
                    yield i, item
            except BadSampleError as e:
                yield i, e

    def _run_ahead(self) -> None:
        job = self.job
        items = prefetch(self._read_ahead())
        try:
            for i, item in items:
                if isinstance(item, BadSampleError):  # the unit itself is unreadable past this point
                    self.skip(item)
                elif item.__class__ is ColumnBatch:
                    self.batch(job.units[i], job.positions[i], item)
                else:
                    self.row(job.units[i], job.positions[i], item)
            self.roller.finish()
        except BaseException:
            items.close()  # stop the read-ahead thread now, not when the traceback is freed
            self.roller.abort()
            raise

    def run(self) -> None:
        job = self.job
        if (
            self.columns is not None
            and not job.running_positions
            and all(u.kind in ("parquet", "arrow") for u in job.units)
        ):
            self._run_ahead()
            if self.progress is not None and self.pending_n:
                self.progress(self.pending_n, self.pending_b)
            return
        reading: list = []
        running = 0
        try:
            for unit, pos0 in zip(job.units, job.positions):
                if job.running_positions:
                    pos0 = running
                self.shaper.field_hint = TREE_FIELDS_HINT if unit.kind == "tree" else ""
                try:
                    items = read_unit(
                        unit,
                        max_sample_bytes=job.max_sample_bytes,
                        on_bad=self.skip,
                        whole_batches=self.columns is not None,
                    )
                    if self.columns is not None and unit.kind in ("parquet", "arrow"):
                        items = prefetch(items)
                        reading.append(items)
                    for item in items:
                        if item.__class__ is ColumnBatch or item.__class__ is RowChunk:
                            self.batch(unit, pos0, item)
                        else:
                            self.row(unit, pos0, item)
                except BadSampleError as e:  # the unit itself is unreadable past this point
                    self.skip(e)
                if job.running_positions:
                    running += unit.count if unit.count >= 0 else unit.obj.consumed
            self.roller.finish()
        except BaseException:
            for it in reading:  # stop read-ahead threads now, not when the traceback is freed
                it.close()
            self.roller.abort()
            raise
        if self.progress is not None and self.pending_n:
            self.progress(self.pending_n, self.pending_b)


def run_job(job: Job, progress: Callable[[int, int], None] | None = None) -> JobResult:
    result = JobResult(job.task, job.worker)
    _Packer(job, result, progress).run()
    return result
