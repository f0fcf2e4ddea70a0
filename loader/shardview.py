"""One memory-mapped shard, with the byte range of every field of every sample precomputed.

From the sample index alone (never by parsing the shard) we compute, once per shard per
process, where each field's payload lies in the file: tar members from the index's per-field
offsets, Arrow values from the record batches' buffer addresses inside the map (an Arrow IPC
file read from a buffer is zero-copy). Reading a sample is then slicing the map.

For the length field, when it is a 1-D integer array, `token_ranges` gives where the elements
of a batch's samples start and how many there are (vectorised), so a batch is gathered with
one memcpy per row and no per-sample decoding.

A compressed Arrow shard's buffers are not in the file as they are read, so its samples are read
from decompressed record batches instead (`loader.batchcache`: one batch decompressed when a
sample needs it, recently used ones kept); `token_pieces` groups a training batch's samples by
record batch, so each is decompressed at most once per training batch and its tokens are gathered
with the same one-memcpy-per-row path as a plain shard's. (The node cache holds such shards
plain, `cache.plain`: this path serves datasets read in place or ranged, without a cache; a
remote shard's view has no map, ``fetch`` reading its record batches by range.)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

from ..format import FieldSpec, FormatError, decode_bytes
from ..format.arrowshard import check_schema
from .batchcache import CompressedBatches, column_ranges
from .remotefetch import RemoteBatches
from .source import ShardFile
from .tokenpieces import TokenPiece


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

    def __init__(
        self,
        mapped: ShardFile,
        index,
        fields: list[FieldSpec],
        *,
        tar: bool,
        pad_field: str | None,
        allow_pickle: bool = False,
        compressed: bool = False,
        plain_bytes: int = 0,
        fetch: RemoteBatches | None = None,
    ):
        self.mapped = mapped
        self.name = mapped.shard_name
        self.keys = np.array(index.keys, dtype=object)
        self.fields = fields
        n, nf = len(index), len(fields)
        buf = mapped.buffer()
        self.u8: np.ndarray | None = np.frombuffer(buf, dtype=np.uint8)  # None once closed
        self.decoders = [decoder(f, tar, allow_pickle, f"shard {self.name}") for f in fields]
        # The length field's elements (`_fast_tokens`): the map as that dtype, and as raw bytes.
        self.tok_view: np.ndarray | None = None
        self.tok_bytes: memoryview | None = None
        self.tok_dtype: np.dtype | None = None  # the length field's dtype where batches gather it fast
        self._tok_ranges: tuple[np.ndarray, np.ndarray] | None = None
        self.bytes_besides_tokens: int | None = None
        self.pad_col = next((j for j, f in enumerate(fields) if f.name == pad_field), None)
        self._batches: CompressedBatches | None = None
        if compressed and not tar:
            fast = self.pad_col is not None and is_int_array(fields[self.pad_col])
            self._batches = CompressedBatches(
                buf, index, fields, self.name, self.pad_col if fast else None, plain_bytes, fetch
            )
            self.bytes_fields = [False] * nf  # no slices of the map to hand out
            # A read touches its record batch: each sample's share of its batch's stored bytes.
            _, where, rows = np.unique(index.batch, return_inverse=True, return_counts=True)
            self.sample_bytes = index.sizes.astype(np.int64) // rows[where.reshape(-1)]
            if self.pad_col is not None and is_int_array(fields[self.pad_col]):
                self.tok_dtype = np.dtype(fields[self.pad_col].dtype)
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
        self.tok_view = tok_view = np.frombuffer(
            self.mapped.buffer(), dtype=np.dtype(spec.dtype), count=self.mapped.size // np.dtype(spec.dtype).itemsize
        )
        self.tok_dtype = tok_view.dtype
        self.tok_bytes = memoryview(self.mapped.buffer()).cast("B")  # rows are copied as raw bytes
        self._tok_ranges = self._parse(self.starts[:, self.pad_col], self.sizes[:, self.pad_col], npy=tar)
        # When every sample has the same bytes besides its tokens (a token-only shard: the npy
        # header), a batch's payload bytes follow from its token counts, with no gather of its own.
        self.bytes_besides_tokens = None
        if self._tok_ranges is not None and len(self.sample_bytes):
            other = self.sample_bytes - self._tok_ranges[1] * tok_view.itemsize
            if (other == other[0]).all():
                self.bytes_besides_tokens = int(other[0])

    def token_ranges(self, li: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """(first element, element count) of the length field's payload for samples ``li``;
        None where a payload is not a plain array (the caller decodes sample by sample)."""
        if self._tok_ranges is None:
            return None
        return self._tok_ranges[0][li], self._tok_ranges[1][li]

    def token_pieces(self, rows: np.ndarray, li: np.ndarray) -> list[TokenPiece] | None:
        """[(rows, first element, element count, which, buffers)]: where the length field's payload
        of samples ``li`` (rows ``rows`` of a batch) lies, sample k's in ``buffers[which[k]]`` (raw
        bytes): the map for a plain shard, its decompressed record batches for a compressed one;
        None where one is not a plain array."""
        if self._batches is None:
            r = self.token_ranges(li)
            return None if r is None else [TokenPiece(rows, r[0], r[1], np.zeros(len(li), np.int64), [self.tok_bytes])]
        if self.tok_dtype is None:
            return None
        return self._batches.token_pieces(rows, li)

    def _parse(self, start: np.ndarray, size: np.ndarray, *, npy: bool) -> tuple[np.ndarray, np.ndarray] | None:
        """(first element, element count) of every sample's payload at byte ``start``, ``size``
        (new arrays: the inputs are only read); None where one is not a plain array."""
        if npy:
            # npy 1.0: magic(6) version(2) header_len(2, little endian) header; data after it.
            u8 = self.u8
            if u8 is None:
                raise RuntimeError("shardtool internal error: parsed as the view opens, long before `close`")
            if len(start) and ((size < 10).any() or (u8[start] != 0x93).any() or (u8[start + 6] != 1).any()):
                return None
            header = 10 + u8[start + 8].astype(np.int64) + (u8[start + 9].astype(np.int64) << 8)
            start, size = start + header, size - header
        if self.tok_view is None:
            raise RuntimeError("shardtool internal error: `_fast_tokens` maps it before it parses")
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

    def values(self, j: int, li: np.ndarray) -> list[Any]:
        """`value` of field ``j`` of samples ``li``; a compressed shard's read run by run of a
        record batch, not through three calls per sample."""
        if self._batches is None:
            return [self.value(j, i) for i in li.tolist()]
        decode = self.decoders[j]
        try:
            return [decode(raw) for raw in self._batches.fields_bytes(li, j)]
        except FormatError:
            raise
        except Exception:
            return [self.value(j, i) for i in li.tolist()]  # again, to name the sample that fails

    def sample(self, i: int) -> dict[str, Any]:
        out = {"__key__": self.keys[i]}
        for j, f in enumerate(self.fields):
            out[f.name] = self.value(j, i)
        return out

    def fetch_ahead(self, li: np.ndarray) -> None:
        """A remote shard's: start fetching the record batches of samples ``li`` (`CompressedBatches.fetch_ahead`)."""
        if self._batches is not None:
            self._batches.fetch_ahead(li)

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
            st[:, j], sz[:, j] = column_ranges(rb.column(j + 1), spec, base, m)
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
        raise FormatError(
            f"{name}: Arrow buffers are not in the file (a compressed shard the manifest does not declare compressed?)"
        )
    return starts, sizes
