"""Columnar fast path: a whole Arrow record batch → its tar members, laid out in one buffer.

The per-row path (reader → ``Shaper.shape`` → ``TarShardWriter.write_fast``) costs tens of
microseconds of Python per sample; for a batch of token lists that dominates packing. Here the
batch's headers are built as one array (``headers_batch``), payloads are copied straight from
the Arrow buffers (npy headers cached per length), and the writer gets one large block.

The output is byte-identical to the per-row path. Anything this path does not handle exactly
(keys from a column, length functions, nulls, JSON-stored fields, long names, over-sized samples)
makes :meth:`BatchEncoder.encode` return ``None`` and the caller packs that batch row by row,
which also produces the row-level errors.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..format.fields import FieldSpec, npy_header
from ..format.tarshard import BLOCK, headers_batch


@dataclass
class EncodedBatch:
    data: np.ndarray  # uint8, every sample's members back to back (reused by the next batch)
    keys: list[str]
    offsets: np.ndarray  # (n + 1,) sample boundaries in ``data``
    field_offsets: np.ndarray  # (n, F) payload offset relative to the sample start
    field_sizes: np.ndarray  # (n, F) payload sizes
    lengths: np.ndarray  # (n,)
    payload_bytes: int

    def __len__(self) -> int:
        return len(self.keys)


class BatchEncoder:
    """Encodes record batches for one job's fields; ``None`` for a batch it cannot do exactly."""

    def __init__(self, fields: list[FieldSpec], *, key_width: int, length_field: str | None,
                 shard_size: int | None):
        self.fields = fields
        self.names = [f.name for f in fields]
        self.key_width = key_width
        self.length_field = length_field
        self.shard_size = shard_size
        self.member_names = [f".{f.ext}".encode("utf-8") for f in fields]
        self.ok = all(key_width + len(m) <= 100 for m in self.member_names) and all(
            f.storage in ("array", "text", "int", "raw") for f in fields)
        self._buf: np.ndarray | None = None

    # ---------------------------------------------------------------- columns → payloads
    def _column(self, spec: FieldSpec, col):
        """(payload sizes, copy recipe, per-row lengths or None) of one field, or None to decline."""
        import pyarrow.types as pt

        t = col.type
        if col.null_count:
            return None
        if spec.storage == "array":
            if not (pt.is_list(t) or pt.is_large_list(t)) or col.values.null_count:
                return None
            vt = t.value_type
            if not (pt.is_integer(vt) or pt.is_floating(vt)):
                return None
            dtype = np.dtype(spec.dtype)
            offsets = col.offsets.to_numpy().astype(np.int64)
            values = col.values.to_numpy()
            if values.dtype != dtype:
                if not np.can_cast(values.dtype, dtype, "safe"):
                    return None
                values = values.astype(dtype)
            counts = np.diff(offsets)
            uniq, inverse = np.unique(counts, return_inverse=True)
            heads = [npy_header(dtype, u) for u in uniq.tolist()]
            hlen = np.array([len(h) for h in heads], dtype=np.int64)[inverse]
            isz = dtype.itemsize
            sizes = hlen + counts * isz
            return sizes, ("array", heads, inverse, hlen, np.ascontiguousarray(values).view(np.uint8),
                           offsets * isz), counts
        if spec.storage == "int":
            if not pt.is_integer(t):
                return None
            import pyarrow as pa
            import pyarrow.compute as pc  # imported only when needed: it costs ~0.1 s

            values = col.to_numpy()
            col = pc.cast(col, pa.string())
            t = col.type
            lengths = values
        else:
            lengths = None
        if spec.storage == "text":
            if not (pt.is_string(t) or pt.is_large_string(t)):
                return None
            try:  # invalid UTF-8 must fail as the row path fails (it decodes every string)
                col.validate(full=True)
            except Exception:
                return None
        if spec.storage == "raw" and not (pt.is_binary(t) or pt.is_large_binary(t)):
            return None
        big = pt.is_large_string(t) or pt.is_large_binary(t)
        bufs = col.buffers()
        offsets = np.frombuffer(bufs[1], dtype=np.int64 if big else np.int32)[col.offset : col.offset + len(col) + 1]
        offsets = offsets.astype(np.int64)
        data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
        if spec.storage == "text" and self.length_field == spec.name:
            import pyarrow.compute as pc

            lengths = pc.utf8_length(col).to_numpy().astype(np.int64)
        return np.diff(offsets), ("bytes", data, offsets), lengths

    def _buffer(self, n: int) -> np.ndarray:
        # One buffer for every batch: a fresh 30 MB array per batch costs page faults each time.
        # The caller writes a batch out before encoding the next, so reusing it is safe.
        if self._buf is None or len(self._buf) < n:
            self._buf = np.empty(max(n, 1 << 20) * 5 // 4 // BLOCK * BLOCK + BLOCK, dtype=np.uint8)
        return self._buf[:n]

    # ---------------------------------------------------------------- the batch
    def encode(self, batch, first_position: int) -> EncodedBatch | None:
        if not self.ok or sorted(batch.schema.names) != sorted(self.names):
            return None
        n = batch.num_rows
        if n == 0:
            return None
        cols = []
        for spec in self.fields:
            got = self._column(spec, batch.column(batch.schema.get_field_index(spec.name)))
            if got is None:
                return None
            cols.append(got)
        F = len(self.fields)
        sizes = np.stack([c[0] for c in cols], axis=1)  # (n, F)
        if self.length_field is not None:
            j = self.names.index(self.length_field)
            lengths = cols[j][2]
            if lengths is None or (len(lengths) and lengths.min() < 0):
                return None
            lengths = lengths.astype(np.int64)
        else:
            lengths = sizes.sum(axis=1)
        padded = BLOCK + (sizes + (BLOCK - 1)) // BLOCK * BLOCK  # header + payload + padding
        sample_sizes = padded.sum(axis=1)
        if self.shard_size is not None and int(sample_sizes.max()) > self.shard_size:
            return None  # the row path reports it
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(sample_sizes, out=offsets[1:])
        member_rel = np.zeros((n, F), dtype=np.int64)
        np.cumsum(padded[:, :-1], axis=1, out=member_rel[:, 1:])
        field_offsets = member_rel + BLOCK
        starts = offsets[:-1, None] + member_rel  # header position of every member

        keys = [f"{p:0{self.key_width}d}" for p in range(first_position, first_position + n)]
        key_bytes = "".join(keys).encode("ascii")
        if len(key_bytes) != n * self.key_width:
            return None
        key_arr = np.frombuffer(key_bytes, dtype=np.uint8).reshape(n, self.key_width)
        total = int(offsets[-1])
        data = self._buffer(total)
        blocks = data.reshape(-1, BLOCK)
        # The reused buffer holds the last batch: zero each payload's final block (its padding);
        # headers and payloads overwrite everything else.
        last = (starts + BLOCK + np.maximum(sizes - 1, 0)) // BLOCK
        blocks[last[sizes > 0]] = 0
        for j, suffix in enumerate(self.member_names):
            names = np.empty((n, self.key_width + len(suffix)), dtype=np.uint8)
            names[:, : self.key_width] = key_arr
            names[:, self.key_width :] = np.frombuffer(suffix, dtype=np.uint8)
            blocks[starts[:, j] // BLOCK] = headers_batch(names, sizes[:, j])
        mv = memoryview(data)
        for j, (_, recipe, _) in enumerate(cols):
            dst = (starts[:, j] + BLOCK).tolist()
            if recipe[0] == "bytes":
                src = memoryview(recipe[1])
                offs = recipe[2].tolist()
                for i in range(n):
                    a, b = offs[i], offs[i + 1]
                    mv[dst[i] : dst[i] + b - a] = src[a:b]
            else:
                _, heads, inverse, hlen, src, offs = recipe
                src = memoryview(src)
                offs = offs.tolist()
                inv = inverse.tolist()
                hl = hlen.tolist()
                for i in range(n):
                    d = dst[i]
                    e = d + hl[i]
                    mv[d:e] = heads[inv[i]]
                    a, b = offs[i], offs[i + 1]
                    mv[e : e + b - a] = src[a:b]
        return EncodedBatch(data, keys, offsets, field_offsets, sizes, lengths, int(sizes.sum()))
