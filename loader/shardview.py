"""One memory-mapped shard, with the byte range of every field of every sample precomputed.

From the sample index alone (never by parsing the shard) we compute, once per shard per
process, where each field's payload lies in the file: tar members from the index's per-field
offsets, Arrow values from the record batches' buffer addresses inside the map (an Arrow IPC
file read from a buffer is zero-copy). Reading a sample is then slicing the map.

For the length field, when it is a 1-D integer array, `token_ranges` gives where the elements
of a batch's samples start and how many there are (vectorised), so a batch is gathered with
one memcpy per row and no per-sample decoding.

A compressed Arrow shard's buffers are not in the file as they are read, so its samples are read
from decompressed record batches instead (`_CompressedBatches`: one batch decompressed when a
sample needs it, the last few kept); the uncompressed path is unchanged.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

from ..format import FieldSpec, FormatError, decode_bytes
from ..format.arrowshard import check_schema
from .source import MappedFile


def is_int_array(spec: FieldSpec) -> bool:
    return spec.storage == "array" and bool(spec.dtype) and np.dtype(spec.dtype).kind in "iub"


def decoder(spec: FieldSpec, tar: bool, allow_pickle: bool, where: str) -> Callable[[bytes], Any]:
    """bytes of one payload -> the value `Dataset.read` would return for it."""
    if tar or spec.storage == "raw":
        enc = spec.encoding
        what = f"{where} field {spec.name!r}"
        return lambda raw: decode_bytes(enc, raw, allow_pickle=allow_pickle, what=what)
    if spec.storage == "array":
        dtype = np.dtype(spec.dtype)
        return lambda raw: np.frombuffer(raw, dtype=dtype)
    if spec.storage == "text":
        return lambda raw: raw.decode("utf-8")
    if spec.storage == "json":
        return json.loads
    if spec.storage == "int":
        return lambda raw: int.from_bytes(raw, "little", signed=True)
    raise FormatError(f"{where}: field {spec.name!r} has unknown storage {spec.storage!r}")


def yields_bytes(spec: FieldSpec, tar: bool) -> bool:
    return (tar or spec.storage == "raw") and spec.encoding == "bytes"


class ShardView:
    """Byte ranges of every field of every sample of one shard, and its map."""

    def __init__(self, mapped: MappedFile, index, fields: list[FieldSpec], *, tar: bool,
                 pad_field: str | None, allow_pickle: bool = False, compressed: bool = False):
        self.mapped = mapped
        self.name = mapped.shard_name
        self.keys = np.array(index.keys, dtype=object)
        self.fields = fields
        n, nf = len(index), len(fields)
        buf = mapped.buffer()
        self.u8 = np.frombuffer(buf, dtype=np.uint8)
        self.decoders = [decoder(f, tar, allow_pickle, f"shard {self.name}") for f in fields]
        self.tok_view = self.tok_bytes = None
        self._tok_ranges = self.bytes_besides_tokens = None
        self.pad_col = next((j for j, f in enumerate(fields) if f.name == pad_field), None)
        self._batches = None
        if compressed and not tar:
            self._batches = _CompressedBatches(buf, index, fields, self.name)
            self.bytes_fields = [False] * nf  # no slices of the map to hand out
            # A read touches its record batch: each sample's share of its batch's stored bytes.
            _, where, rows = np.unique(index.batch, return_inverse=True, return_counts=True)
            self.sample_bytes = index.sizes.astype(np.int64) // rows[where.reshape(-1)]
            return
        if tar:
            self.starts = index.offsets.astype(np.int64)[:, None] + index.field_offsets.astype(np.int64)
            self.sizes = index.field_sizes.astype(np.int64).reshape(n, nf)
        else:
            self.starts, self.sizes = _arrow_ranges(buf, mapped.size, index, fields, self.name)
        if n and int((self.starts + self.sizes).max(initial=0)) > mapped.size:
            raise FormatError(f"shard {self.name}: sample index points past the end of the shard")
        self.sample_bytes = self.sizes.sum(axis=1)  # payload bytes per sample: what a read touches
        self.bytes_fields = [yields_bytes(f, tar) for f in fields]
        if self.pad_col is not None and is_int_array(fields[self.pad_col]):
            self._fast_tokens(fields[self.pad_col], tar)

    def _fast_tokens(self, spec: FieldSpec, tar: bool) -> None:
        # Parsed once per shard for all samples: per-batch parsing (only the samples read) saved
        # a worker's start-up but cost more per batch when a batch spans many shards.
        self.tok_view = np.frombuffer(self.mapped.buffer(), dtype=np.dtype(spec.dtype),
                                      count=self.mapped.size // np.dtype(spec.dtype).itemsize)
        self.tok_bytes = memoryview(self.mapped.buffer()).cast("B")  # rows are copied as raw bytes
        self._tok_ranges = self._parse(self.starts[:, self.pad_col], self.sizes[:, self.pad_col], npy=tar)
        # When every sample has the same bytes besides its tokens (a token-only shard: the npy
        # header), a batch's payload bytes follow from its token counts, with no gather of its own.
        self.bytes_besides_tokens = None
        if self._tok_ranges is not None and len(self.sample_bytes):
            other = self.sample_bytes - self._tok_ranges[1] * self.tok_view.itemsize
            if (other == other[0]).all():
                self.bytes_besides_tokens = int(other[0])

    def token_ranges(self, li: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """(first element, element count) of the length field's payload for samples ``li``;
        None where a payload is not a plain array (the caller decodes sample by sample)."""
        if self._tok_ranges is None:
            return None
        return self._tok_ranges[0][li], self._tok_ranges[1][li]

    def _parse(self, start: np.ndarray, size: np.ndarray, *, npy: bool) -> tuple[np.ndarray, np.ndarray] | None:
        """(first element, element count) of every sample's payload at byte ``start``, ``size``
        (new arrays: the inputs are only read); None where one is not a plain array."""
        if npy:
            # npy 1.0: magic(6) version(2) header_len(2, little endian) header; data after it.
            u8 = self.u8
            if len(start) and ((size < 10).any() or (u8[start] != 0x93).any() or (u8[start + 6] != 1).any()):
                return None
            header = 10 + u8[start + 8].astype(np.int64) + (u8[start + 9].astype(np.int64) << 8)
            start, size = start + header, size - header
        item = self.tok_view.itemsize
        if len(start) and ((start % item).any() or (size % item).any() or (size < 0).any()):
            return None
        return start // item, size // item

    def raw(self, j: int, i: int) -> bytes:
        if self._batches is not None:
            return self._batches.field_bytes(i, j)
        a = int(self.starts[i, j])
        return self.mapped.buffer()[a : a + int(self.sizes[i, j])]

    def value(self, j: int, i: int) -> Any:
        try:
            return self.decoders[j](self.raw(j, i))
        except FormatError:
            raise
        except Exception as e:
            raise FormatError(
                f"shard {self.name} sample #{i} ({self.keys[i]}): field {self.fields[j].name!r} "
                f"cannot be decoded ({type(e).__name__}: {e})"
            ) from e

    def sample(self, i: int) -> dict[str, Any]:
        out = {"__key__": self.keys[i]}
        for j, f in enumerate(self.fields):
            out[f.name] = self.value(j, i)
        return out

    def close(self) -> None:
        if self.tok_bytes is not None:
            self.tok_bytes.release()
        if self._batches is not None:
            self._batches.close()
        self.u8 = self.tok_view = self.tok_bytes = self._batches = None
        self.mapped.close()


def _arrow_ranges(buf, file_size: int, index, fields: list[FieldSpec], name: str):
    """Absolute byte ranges of each field's value in every row, from buffer addresses."""
    pbuf = pa.py_buffer(buf)
    base = pbuf.address
    try:
        reader = pa.ipc.open_file(pbuf)
    except (pa.ArrowInvalid, OSError) as e:
        raise FormatError(f"{name}: not a readable Arrow IPC file ({e})") from None
    check_schema(reader.schema, fields, name)
    per_batch_starts, per_batch_sizes, rows_before = [], [], [0]
    for k in range(reader.num_record_batches):
        rb = reader.get_batch(k)
        m = rb.num_rows
        st = np.empty((m, len(fields)), dtype=np.int64)
        sz = np.empty((m, len(fields)), dtype=np.int64)
        for j, spec in enumerate(fields):
            st[:, j], sz[:, j] = _column_ranges(rb.column(j + 1), spec, base, m)
        per_batch_starts.append(st)
        per_batch_sizes.append(sz)
        rows_before.append(rows_before[-1] + m)
    if not per_batch_starts:
        return np.zeros((0, len(fields)), np.int64), np.zeros((0, len(fields)), np.int64)
    starts, sizes = np.concatenate(per_batch_starts), np.concatenate(per_batch_sizes)
    pos = np.asarray(rows_before, dtype=np.int64)[index.batch.astype(np.int64)] + index.row.astype(np.int64)
    starts, sizes = starts[pos], sizes[pos]
    starts[sizes == 0] = 0  # an empty buffer may live anywhere
    if len(starts) and ((starts < 0) | (starts + sizes > file_size)).any():
        # Buffers outside the map mean Arrow decompressed or copied them: a shard compressed
        # though its manifest says it is not.
        raise FormatError(f"{name}: Arrow buffers are not in the file (a compressed shard the manifest does not "
                          "declare compressed?)")
    return starts, sizes


def _column_ranges(col, spec: FieldSpec, base: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    bufs = col.buffers()
    if spec.storage == "array":
        offs = col.offsets.to_numpy().astype(np.int64)
        values = col.values
        item = np.dtype(spec.dtype).itemsize
        data = values.buffers()[1]
        addr = (data.address - base) if data is not None else 0
        return addr + (values.offset + offs[:-1]) * item, np.diff(offs) * item
    if spec.storage == "int":
        return (bufs[1].address - base) + (col.offset + np.arange(m, dtype=np.int64)) * 8, np.full(m, 8, np.int64)
    offs = np.frombuffer(bufs[1], dtype=np.int32)[col.offset : col.offset + m + 1].astype(np.int64)
    addr = (bufs[2].address - base) if bufs[2] is not None else 0
    return addr + offs[:-1], np.diff(offs)


def _data_buffer(col, spec: FieldSpec):
    """The buffer holding a column's values, which `_column_ranges` addresses are relative to."""
    if spec.storage == "array":
        return col.values.buffers()[1]
    return col.buffers()[1] if spec.storage == "int" else col.buffers()[2]


class _CompressedBatches:
    """Samples of a compressed Arrow shard: each record batch decompressed when first needed and
    kept in a per-process cache of decompressed batches (`CACHE_BYTES` over every shard, least
    recently used evicted), so a shard read again and again is decompressed about once."""

    CACHE_BYTES = 256 << 20
    _cache: OrderedDict = OrderedDict()  # (view id, batch) -> (fields' (buffer, starts, sizes), bytes)
    _cached_bytes = 0
    _next_id = 0

    def __init__(self, buf, index, fields: list[FieldSpec], name: str):
        try:
            # One thread: a record batch is small, and Arrow's pool spent more on handing its
            # columns out than on decompressing them (131 against 196 us a 64 KiB zstd batch).
            self.reader = pa.ipc.open_file(pa.py_buffer(buf), options=pa.ipc.IpcReadOptions(use_threads=False))
        except (pa.ArrowInvalid, OSError) as e:
            raise FormatError(f"{name}: not a readable Arrow IPC file ({e})") from None
        check_schema(self.reader.schema, fields, name)
        self.fields, self.name = fields, name
        self.batch, self.row = index.batch, index.row
        cls = _CompressedBatches
        self.uid = cls._next_id
        cls._next_id += 1
        self._mine: set[int] = set()

    def _decoded(self, b: int) -> list:
        cls = _CompressedBatches
        key = (self.uid, b)
        hit = cls._cache.get(key)
        if hit is not None:
            cls._cache.move_to_end(key)
            return hit[0]
        try:
            rb = self.reader.get_batch(b)
        except (pa.ArrowInvalid, OSError, IndexError) as e:
            raise FormatError(f"{self.name}: record batch {b} cannot be decompressed ({e})") from None
        got = []
        for j, spec in enumerate(self.fields):
            col = rb.column(j + 1)
            data = _data_buffer(col, spec)
            base = data.address if data is not None else 0
            starts, sizes = _column_ranges(col, spec, base, rb.num_rows)
            got.append((data, starts, sizes))
        nbytes = rb.nbytes
        cls._cache[key] = (got, nbytes)
        cls._cached_bytes += nbytes
        self._mine.add(b)
        while cls._cached_bytes > cls.CACHE_BYTES and len(cls._cache) > 1:
            (uid, old), (_, n) = cls._cache.popitem(last=False)
            cls._cached_bytes -= n
        return got

    def field_bytes(self, i: int, j: int) -> bytes:
        data, starts, sizes = self._decoded(int(self.batch[i]))[j]
        r = int(self.row[i])
        size = int(sizes[r])
        return data[int(starts[r]) : int(starts[r]) + size].to_pybytes() if size else b""

    def close(self) -> None:
        cls = _CompressedBatches
        for b in self._mine:
            hit = cls._cache.pop((self.uid, b), None)
            if hit is not None:
                cls._cached_bytes -= hit[1]
        self._mine.clear()
