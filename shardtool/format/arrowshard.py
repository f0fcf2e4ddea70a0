"""Arrow IPC shards: one row per sample, a ``__key__`` column and one column per field.

Record batches are kept small (a few hundred rows or about 1 MiB) so that reading one sample
touches one small batch; the file is memory-mappable. Each batch's byte range is recorded in
the sample index, so a remote reader can fetch just that range.
"""
from __future__ import annotations

import json
from typing import IO, Any

import numpy as np
import pyarrow as pa

from .errors import FormatError
from .fields import FieldSpec, as_array, json_text

KEY_COLUMN = "__key__"
DEFAULT_BATCH_ROWS = 256
DEFAULT_BATCH_BYTES = 1 << 20


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


class ArrowShardWriter:
    """Buffers rows and writes small record batches, recording each batch's byte range."""

    def __init__(self, f: IO[bytes], fields: list[FieldSpec], *, batch_rows: int = DEFAULT_BATCH_ROWS,
                 batch_bytes: int = DEFAULT_BATCH_BYTES):
        self.fields = fields
        self.schema = schema_for(fields)
        self.sink = pa.PythonFile(f, mode="w")
        self.writer = pa.ipc.new_file(self.sink, self.schema)
        self.batch_rows = batch_rows
        self.batch_bytes = batch_bytes
        self._keys: list[str] = []
        self._cols: list[list[Any]] = [[] for _ in fields]
        self._pending_bytes = 0
        self.batch_ranges: list[tuple[int, int]] = []

    def write(self, key: str, values: list[Any], approx_bytes: int) -> tuple[int, int]:
        """Queue one sample; returns its (batch number, row in batch)."""
        row = len(self._keys)
        self._keys.append(key)
        for col, v in zip(self._cols, values):
            col.append(v)
        self._pending_bytes += approx_bytes
        where = (len(self.batch_ranges), row)
        if len(self._keys) >= self.batch_rows or self._pending_bytes >= self.batch_bytes:
            self._flush()
        return where

    def _flush(self) -> None:
        if not self._keys:
            return
        arrays = [pa.array(self._keys, type=pa.string())]
        arrays += [_column(spec, col) for spec, col in zip(self.fields, self._cols)]
        batch = pa.RecordBatch.from_arrays(arrays, schema=self.schema)
        start = self.sink.tell()
        self.writer.write_batch(batch)
        self.batch_ranges.append((start, self.sink.tell() - start))
        self._keys = []
        self._cols = [[] for _ in self.fields]
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


def record_batch_from_range(data: bytes, schema: pa.Schema) -> pa.RecordBatch:
    """Decode one record batch from the byte range the sample index records for it.

    The first batch's range starts at the file's beginning (the writer emits the magic and the
    schema message with it), so leading non-batch messages are skipped.
    """
    buf = pa.py_buffer(data)
    if data[:6] == b"ARROW1":
        buf = buf.slice(8)
    messages = pa.ipc.MessageReader.open_stream(buf)
    while True:
        message = messages.read_next_message()  # StopIteration if the range holds no batch
        if message.type == "record batch":
            return pa.ipc.read_record_batch(message, schema)


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
