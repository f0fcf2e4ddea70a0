"""Tar members of a whole shard batch (``columns.ShardBatch``), laid out in one buffer.

The per-sample path (``Shaper.shape`` → ``TarShardWriter.write_fast``) costs tens of
microseconds of Python per sample; here the batch's headers are built as one array
(``headers_batch``, names padded with NULs as ustar pads them), payloads are copied straight from
the Arrow buffers (npy headers cached per length), and the writer gets one large block.

The output is byte-identical to the per-sample path. A batch holding a member name over 100
bytes (a PAX record) or a sample larger than the shard size makes :meth:`TarEncoder.encode`
return ``None``, and the caller packs it sample by sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from ..format.fields import FieldSpec, npy_header
from ..format.tarshard import BLOCK, headers_batch
from .columns import ShardBatch


@dataclass
class EncodedBatch:
    data: np.ndarray  # uint8, every sample's members back to back (reused by the next batch)
    keys: pa.Array  # strings
    offsets: np.ndarray  # (n + 1,) sample boundaries in ``data``
    field_offsets: np.ndarray  # (n, F) payload offset relative to the sample start
    field_sizes: np.ndarray  # (n, F) payload sizes
    lengths: np.ndarray  # (n,)
    payload_bytes: int

    def __len__(self) -> int:
        return len(self.keys)


def _string_buffers(col) -> tuple[np.ndarray, np.ndarray]:
    """(data bytes, offsets) of a string/binary array with 32-bit offsets."""
    bufs = col.buffers()
    offsets = np.frombuffer(bufs[1], dtype=np.int32)[col.offset : col.offset + len(col) + 1].astype(np.int64)
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
    return data, offsets


def key_names(keys) -> tuple[np.ndarray, np.ndarray]:
    """Keys as rows of a NUL-padded uint8 matrix, and each key's length in bytes."""
    data, offsets = _string_buffers(keys)
    lens = np.diff(offsets)
    width = int(lens.max(initial=0))
    cols = np.arange(width, dtype=np.int64)
    idx = offsets[:-1, None] + cols[None, :]
    mask = cols[None, :] < lens[:, None]
    names = np.zeros((len(lens), width), dtype=np.uint8)
    if len(data):
        names[mask] = data[idx[mask]]
    return names, lens


class TarEncoder:
    """Lays out the tar members of shard batches for one job's fields."""

    def __init__(self, fields: list[FieldSpec], *, shard_size: int | None):
        self.fields = fields
        self.shard_size = shard_size
        self.member_names = [f".{f.ext}".encode() for f in fields]
        self._buf: np.ndarray | None = None

    def _recipe(self, spec: FieldSpec, col):
        """How to copy one field's payloads: ("bytes", data, offsets) or ("array", …)."""
        if spec.storage == "array":
            dtype = np.dtype(spec.dtype)
            offsets = col.offsets.to_numpy().astype(np.int64)
            values = col.values.to_numpy()
            counts = np.diff(offsets)
            uniq, inverse = np.unique(counts, return_inverse=True)
            heads = [npy_header(dtype, u) for u in uniq.tolist()]
            hlen = np.array([len(h) for h in heads], dtype=np.int64)[inverse]
            return (
                "array",
                heads,
                inverse,
                hlen,
                np.ascontiguousarray(values).view(np.uint8),
                offsets * dtype.itemsize,
            )
        if spec.storage == "int":
            col = col.cast(pa.string())
        return ("bytes", *_string_buffers(col))

    def _buffer(self, n: int) -> np.ndarray:
        # One buffer for every batch: a fresh 30 MB array per batch costs page faults each time.
        # The caller writes a batch out before encoding the next, so reusing it is safe.
        if self._buf is None or len(self._buf) < n:
            self._buf = np.empty(max(n, 1 << 20) * 5 // 4 // BLOCK * BLOCK + BLOCK, dtype=np.uint8)
        return self._buf[:n]

    def encode(self, sb: ShardBatch) -> EncodedBatch | None:
        n = len(sb)
        if n == 0:
            return None
        key_mat, key_lens = key_names(sb.batch.column(0))
        if int(key_lens.max()) + max(len(m) for m in self.member_names) > 100:
            return None  # a PAX name: the per-sample path writes it
        F = len(self.fields)
        sizes = sb.sizes
        padded = BLOCK + (sizes + (BLOCK - 1)) // BLOCK * BLOCK  # header + payload + padding
        sample_sizes = padded.sum(axis=1)
        if self.shard_size is not None and int(sample_sizes.max()) > self.shard_size:
            return None  # the per-sample path reports it
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(sample_sizes, out=offsets[1:])
        member_rel = np.zeros((n, F), dtype=np.int64)
        np.cumsum(padded[:, :-1], axis=1, out=member_rel[:, 1:])
        field_offsets = member_rel + BLOCK
        starts = offsets[:-1, None] + member_rel  # header position of every member
        total = int(offsets[-1])
        data = self._buffer(total)
        blocks = data.reshape(-1, BLOCK)
        # The reused buffer holds the last batch: zero each payload's final block (its padding);
        # headers and payloads overwrite everything else.
        last = (starts + BLOCK + np.maximum(sizes - 1, 0)) // BLOCK
        blocks[last[sizes > 0]] = 0
        rows = np.arange(n)[:, None]
        for j, suffix in enumerate(self.member_names):
            names = np.zeros((n, key_mat.shape[1] + len(suffix)), dtype=np.uint8)
            names[:, : key_mat.shape[1]] = key_mat
            names[rows, key_lens[:, None] + np.arange(len(suffix))] = np.frombuffer(suffix, dtype=np.uint8)
            blocks[starts[:, j] // BLOCK] = headers_batch(names, sizes[:, j])
        mv = data.data  # memoryview(data): numpy's stubs give ndarray __buffer__ only from Python 3.12
        for j, spec in enumerate(self.fields):
            recipe = self._recipe(spec, sb.batch.column(j + 1))
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
        return EncodedBatch(data, sb.batch.column(0), offsets, field_offsets, sizes, sb.lengths, int(sizes.sum()))
