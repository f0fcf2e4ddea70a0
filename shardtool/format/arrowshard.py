"""Arrow IPC shards: one row per sample, a ``__key__`` column and one column per field.

Record batches are kept small (a few hundred rows or about 1 MiB) so that reading one sample
touches one small batch; the file is memory-mappable. Each batch's byte range is recorded in
the sample index, so a remote reader can fetch just that range.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from typing import IO, Any

import numpy as np
import pyarrow as pa

from .errors import FormatError
from .fields import FieldSpec, as_array, json_text

KEY_COLUMN = "__key__"
DEFAULT_BATCH_ROWS = 256
DEFAULT_BATCH_BYTES = 1 << 20
# Compressed batches are as large as plain ones, with no row cap below their bytes: Arrow
# decompresses every buffer of a batch with a fresh zstd context (~25 us each, 6 buffers a batch
# here), so 64 KiB batches decompressed at 0.24 GB/s a core and 1 MiB ones at 0.9 (plain zstd of
# the same bytes: ~1 GB/s). Readers decompress each batch about once per pass (the node cache
# once per node, `cache.plain`; reads in place keep decompressed batches, `loader.batchcache`),
# so a batch's size sets what a pass costs, not what one sample costs. Datasets packed with
# 64 KiB batches read as before.
COMPRESSED_BATCH_BYTES = 1 << 20
COMPRESSED_BATCH_ROWS = 8192


def arrow_type(spec: FieldSpec) -> pa.DataType:
    if spec.storage == "array":
        return pa.list_(pa.from_numpy_dtype(np.dtype(spec.dtype)))
    if spec.storage in ("text", "json"):
        return pa.string()
    if spec.storage == "int":
        return pa.int64()
    return pa.binary()


def schema_for(fields: list[FieldSpec]) -> pa.Schema:
    cols = [pa.field(KEY_COLUMN, pa.string(), nullable=False)]
    cols += [pa.field(f.name, arrow_type(f), nullable=False) for f in fields]
    return pa.schema(cols)


def _column(spec: FieldSpec, values: list[Any]) -> pa.Array:
    if spec.storage == "array":
        arrays = [as_array(spec, v) for v in values]
        offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
        np.cumsum([len(a) for a in arrays], out=offsets[1:])
        flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.dtype(spec.dtype))
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))
    if spec.storage == "json":
        values = [json_text(v) for v in values]
    return pa.array(values, type=arrow_type(spec))


def _concat(pieces: list[pa.RecordBatch], schema: pa.Schema) -> pa.RecordBatch:
    """One record batch of ``pieces``, in fresh buffers. The IPC writer's bytes depend on how a
    batch's buffers are laid out (a slice of a Parquet batch and a freshly built batch of the same
    values serialise differently), so every batch is rebuilt before it is written: then a shard's
    bytes depend only on its values, whichever source or code path produced them."""
    return pa.RecordBatch.from_arrays(
        [pa.concat_arrays([p.column(j) for p in pieces]) for j in range(len(schema))], schema=schema
    )


class ArrowShardWriter:
    """Writes small record batches, recording each batch's byte range.

    Samples arrive one at a time (:meth:`write`, Python values) or as whole record batches in the
    shard's schema (:meth:`write_batch`); either way a batch is cut after the sample that brings it
    to ``batch_rows`` rows or ``batch_bytes`` payload bytes, so the same samples give the same
    batches, and the same bytes, by either route. ``compression`` (``zstd`` or ``lz4``) compresses
    each batch's buffers (Arrow IPC buffer compression); a reader decompresses whole batches
    (see `COMPRESSED_BATCH_BYTES` for their size).
    """

    def __init__(
        self,
        f: IO[bytes],
        fields: list[FieldSpec],
        *,
        batch_rows: int | None = None,
        batch_bytes: int | None = None,
        compression: str | None = None,
    ):
        self.fields = fields
        self.schema = schema_for(fields)
        self.sink = pa.PythonFile(f, mode="w")
        options = pa.ipc.IpcWriteOptions(compression=compression) if compression else None
        self.writer = pa.ipc.new_file(self.sink, self.schema, options=options)
        self.compressed = bool(compression)
        if batch_rows is None:
            batch_rows = COMPRESSED_BATCH_ROWS if compression else DEFAULT_BATCH_ROWS
        self.batch_rows = batch_rows
        if batch_bytes is None:
            batch_bytes = COMPRESSED_BATCH_BYTES if compression else DEFAULT_BATCH_BYTES
        self.batch_bytes = batch_bytes
        self._keys: list[str] = []
        self._cols: list[list[Any]] = [[] for _ in fields]
        self._pieces: list[pa.RecordBatch] = []
        self._pending_rows = 0
        self._pending_bytes = 0
        self.batch_ranges: list[tuple[int, int]] = []
        self.raw_bytes = 0  # what the record batches would take uncompressed

    def write(self, key: str, values: list[Any], approx_bytes: int) -> tuple[int, int]:
        """Queue one sample; returns its (batch number, row in batch)."""
        where = (len(self.batch_ranges), self._pending_rows)
        self._keys.append(key)
        for col, v in zip(self._cols, values):
            col.append(v)
        self._pending_rows += 1
        self._pending_bytes += approx_bytes
        if self._pending_rows >= self.batch_rows or self._pending_bytes >= self.batch_bytes:
            self._flush()
        return where

    def write_batch(self, batch: pa.RecordBatch, sample_bytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Queue a record batch in the shard's schema (``sample_bytes``: each row's payload bytes);
        returns every row's (batch number, row in batch), as :meth:`write` would have."""
        self._rows_to_piece()
        n = batch.num_rows
        batch_no = np.empty(n, dtype=np.int32)
        row = np.empty(n, dtype=np.int32)
        cum = np.cumsum(np.asarray(sample_bytes, dtype=np.int64))
        i = 0
        while i < n:
            base = int(cum[i - 1]) if i else 0
            # The sample that closes the current batch: by row count, or by payload bytes.
            j = min(
                i + self.batch_rows - self._pending_rows - 1,
                i + int(np.searchsorted(cum[i:], base + self.batch_bytes - self._pending_bytes, side="left")),
            )
            stop = min(j + 1, n)
            batch_no[i:stop] = len(self.batch_ranges)
            row[i:stop] = self._pending_rows + np.arange(stop - i)
            self._pieces.append(batch.slice(i, stop - i))
            self._pending_rows += stop - i
            self._pending_bytes += int(cum[stop - 1]) - base
            if j < n:
                self._flush()
            i = stop
        return batch_no, row

    def _rows_to_piece(self) -> None:
        if not self._keys:
            return
        arrays = [pa.array(self._keys, type=pa.string())]
        arrays += [_column(spec, col) for spec, col in zip(self.fields, self._cols)]
        self._pieces.append(pa.RecordBatch.from_arrays(arrays, schema=self.schema))
        self._keys = []
        self._cols = [[] for _ in self.fields]

    def _flush(self) -> None:
        self._rows_to_piece()
        if not self._pieces:
            return
        batch = _concat(self._pieces, self.schema)
        start = self.sink.tell()
        self.writer.write_batch(batch)
        self.batch_ranges.append((start, self.sink.tell() - start))
        self.raw_bytes += pa.ipc.get_record_batch_size(batch)
        self._pieces = []
        self._pending_rows = 0
        self._pending_bytes = 0

    def close(self) -> None:
        self._flush()
        self.writer.close()


def check_schema(schema: pa.Schema, fields: list[FieldSpec], shard: str) -> None:
    expected = schema_for(fields)
    if not schema.equals(expected):
        raise FormatError(
            f"{shard}: Arrow schema disagrees with the manifest: found {schema.to_string(show_schema_metadata=False)!r}, "
            f"expected {expected.to_string(show_schema_metadata=False)!r}"
        )


# An Arrow IPC file ends with its footer (the schema and the record batches' places), the
# footer's int32 length and "ARROW1": a footer of a few hundred bytes, with this much before the
# trailer it comes in one read (a file opened for it costs a HEAD, then two reads one after the other).
FOOTER_READ = 64 << 10
_MAGIC = b"ARROW1"


def schema_from_tail(
    read: Callable[[int, int], bytes], size: int, fields: list[FieldSpec], shard: str, tail: int = FOOTER_READ
) -> pa.Schema:
    """The schema in the footer of the Arrow IPC file ``shard`` of ``size`` bytes, checked
    against the manifest's ``fields``: ``read(start, end)`` is asked for its last ``tail``
    bytes, and once more only for a footer longer than that."""
    start = max(0, size - tail)
    data = read(start, size)
    trailer = len(_MAGIC) + 4
    if len(data) != size - start or len(data) < trailer or data[-len(_MAGIC) :] != _MAGIC:
        raise FormatError(f"{shard}: not a readable Arrow IPC file (no Arrow trailer in its last {len(data)} bytes)")
    flen = struct.unpack("<i", data[-trailer : -len(_MAGIC)])[0]
    if not 0 < flen <= size - trailer - 8:
        raise FormatError(f"{shard}: not a readable Arrow IPC file (footer length {flen} in a file of {size} bytes)")
    if flen > len(data) - trailer:
        data = read(size - trailer - flen, size)
    footer = data[len(data) - trailer - flen :]
    try:  # the footer alone, behind the leading magic: the schema is all that is read of it
        schema = pa.ipc.open_file(pa.py_buffer(_MAGIC + b"\0\0" + footer)).schema
    except (pa.ArrowInvalid, OSError) as e:
        raise FormatError(f"{shard}: not a readable Arrow IPC file ({e})") from None
    check_schema(schema, fields, shard)
    return schema


def row_values(batch: pa.RecordBatch, row: int, fields: list[FieldSpec]) -> dict[str, Any]:
    """Decoded values of one row: arrays as numpy (zero-copy where Arrow allows), JSON parsed."""
    out: dict[str, Any] = {KEY_COLUMN: batch.column(0)[row].as_py()}
    for i, spec in enumerate(fields, start=1):
        col = batch.column(i)
        if spec.storage == "array":
            out[spec.name] = _list_row(col, row)
        elif spec.storage == "json":
            out[spec.name] = json.loads(col[row].as_py())
        else:
            out[spec.name] = col[row].as_py()
    return out


def _list_row(col: pa.ListArray, row: int) -> np.ndarray:
    offsets = col.offsets
    start = offsets[row].as_py()
    stop = offsets[row + 1].as_py()
    return col.values.slice(start, stop - start).to_numpy(zero_copy_only=False)
