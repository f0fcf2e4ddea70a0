"""Writing one shard and its sample index, and publishing a dataset's manifest.

A shard is written under a temp name and hashed as it is written (no second read); on
``finish`` the shard, then its index, are renamed into place. The manifest (with the global
lengths file) is published last, so it never points at a partial shard.
"""

from __future__ import annotations

import io
import mmap
import os
from typing import Any

import numpy as np
import pyarrow as pa

from .arrowshard import ArrowShardWriter
from .atomic import atomic_write_bytes, make_temp_path, publish
from .fields import FieldSpec, encode
from .hashing import format_digest, hash_bytes, new_hasher, range_checksum
from .manifest import LENGTHS_NAME, MANIFEST_NAME, Manifest, ShardInfo, length_summary, lengths_to_bytes
from .sindex import ShardIndex
from .sketch import sketch_cells
from .summaries import SUMMARIES_NAME, ShardSummaries
from .tarshard import TarShardWriter

WRITE_BUFFER = 8 << 20
# Every this many bytes, ask the kernel to start writing the shard out (without waiting), so the
# fsync that publishes it finds little left to do and the disk works while we pack.
WRITEBACK_EVERY = 32 << 20
_FADVISE = getattr(os, "posix_fadvise", None)


class _HashingFile(io.RawIOBase):
    """A write-only file that hashes what passes through it and tracks its position."""

    def __init__(self, f):
        self.f = f
        self.h = new_hasher()
        self.pos = 0
        self._written_back = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.h.update(b)
        self.f.write(b)
        n = len(b) if not isinstance(b, memoryview) else b.nbytes
        self.pos += n
        if self.pos - self._written_back >= WRITEBACK_EVERY:
            self._start_writeback()
        return n

    def _start_writeback(self) -> None:
        start, self._written_back = self._written_back, self.pos
        if _FADVISE is None:
            return
        try:
            self.f.flush()
            # On Linux, DONTNEED starts asynchronous writeback of the dirty range (pages still
            # dirty or under writeback stay cached); elsewhere it is at worst a no-op.
            _FADVISE(self.f.fileno(), start, self.pos - start, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        self.f.flush()


class ShardFileWriter:
    """Writes one shard (tar or arrow) + its sample index under ``root/rel_path``.

    Samples arrive one at a time (:meth:`add`, :meth:`add_encoded`) or in blocks (tar members
    laid out by the caller, :meth:`add_tar_block`; Arrow record batches, :meth:`add_arrow_batch`).
    Index columns of blocks stay arrays; per-sample ones are kept as lists and turned into a chunk
    of arrays whenever a block follows them, so both kinds interleave in order.
    """

    def __init__(
        self,
        root: str,
        rel_path: str,
        shard_format: str,
        fields: list[FieldSpec],
        *,
        compression: str | None = None,
        batch_bytes: int | None = None,
    ):
        self.root = root
        self.rel_path = rel_path
        self.index_rel = rel_path.rsplit(".", 1)[0] + ".idx.arrow"
        self.shard_format = shard_format
        self.fields = fields
        self.final = os.path.join(root, rel_path)
        self.tmp = make_temp_path(self.final)
        self._raw = open(self.tmp, "wb", buffering=WRITE_BUFFER)
        self._hf = _HashingFile(self._raw)
        self.count = 0
        self.index_keys: pa.Array | None = None  # every key, once finished
        # per-sample columns not yet in a chunk: keys, lengths, then tar (offset, size, field
        # offsets, field sizes) or arrow (batch, row)
        self._rows: list[list] = [[] for _ in range(6 if shard_format == "tar" else 4)]
        self._chunks: list[tuple] = []
        if shard_format == "tar":
            self._tar = TarShardWriter(self._hf, [f.ext for f in fields])  # type: ignore[arg-type]  # write/tell of a file
        else:
            self._arrow = ArrowShardWriter(self._hf, fields, compression=compression, batch_bytes=batch_bytes)  # type: ignore[arg-type]  # as above

    def _add_row(self, key: str, length: int, *rest) -> None:
        self.count += 1
        for column, v in zip(self._rows, (key, length, *rest)):
            column.append(v)

    def add(self, key: str, values: list[Any], length: int, approx_bytes: int | None = None) -> int:
        """Append a sample (values in ``fields`` order); returns its byte size in the shard (tar)."""
        if self.shard_format == "tar":
            payloads = [encode(spec, v) for spec, v in zip(self.fields, values)]
            e = self._tar.write(key, payloads)
            self._add_row(key, length, e.offset, e.size, e.field_offsets, e.field_sizes)
            return e.size
        size = approx_bytes if approx_bytes is not None else 0
        self._add_row(key, length, *self._arrow.write(key, values, size))
        return size

    def add_encoded(self, key: str, values: list[Any], payloads: list[bytes], length: int) -> None:
        """Append a sample whose tar payloads the caller already encoded (the packer's hot path)."""
        if self.shard_format == "tar":
            self._add_row(key, length, *self._tar.write_fast(key, payloads))
        else:
            self._add_row(key, length, *self._arrow.write(key, values, sum(len(p) for p in payloads)))

    def add_tar_block(
        self, data, keys, offsets: np.ndarray, field_offsets: np.ndarray, field_sizes: np.ndarray, lengths: np.ndarray
    ) -> None:
        """Append consecutive samples whose tar members the caller laid out in ``data``.

        ``keys``: a list or an Arrow string array; ``offsets`` (n + 1,) are the sample boundaries
        relative to ``data``'s start; ``field_offsets`` / ``field_sizes`` are (n, F) as in the
        sample index. One large write (and one hash update) instead of one per sample.
        """
        base = self._tar.write_block(data)
        self._flush_rows()
        self._chunks.append(
            (_key_array(keys), lengths, offsets[:-1] + base, np.diff(offsets), field_offsets, field_sizes)
        )
        self.count += len(lengths)

    def add_arrow_batch(self, batch, lengths: np.ndarray, sample_bytes: np.ndarray) -> None:
        """Append the rows of a record batch in the shard's schema (``__key__`` + fields)."""
        batch_no, row = self._arrow.write_batch(batch, sample_bytes)
        self._flush_rows()
        self._chunks.append((batch.column(0), lengths, batch_no, row))
        self.count += len(lengths)

    def _flush_rows(self) -> None:
        rows = self._rows
        if not rows[0]:
            return
        cols: list[Any] = [pa.array(rows[0], type=pa.string()), np.array(rows[1], dtype=np.int64)]
        if self.shard_format == "tar":
            F = len(self.fields)
            cols += [
                np.array(rows[2], dtype=np.int64),
                np.array(rows[3], dtype=np.int64),
                np.array(rows[4], dtype=np.int64).reshape(-1, F),
                np.array(rows[5], dtype=np.int64).reshape(-1, F),
            ]
        else:
            cols += [np.array(rows[2], dtype=np.int32), np.array(rows[3], dtype=np.int32)]
        self._chunks.append(tuple(cols))
        for column in rows:
            column.clear()

    def abort(self) -> None:
        try:
            self._raw.close()
        finally:
            try:
                os.unlink(self.tmp)
            except OSError:
                pass

    def _columns(self) -> list:
        """The index columns over every chunk, concatenated."""
        self._flush_rows()
        F = len(self.fields)
        if not self._chunks:
            empty = np.zeros(0, np.int64)
            if self.shard_format == "tar":
                return [
                    pa.array([], pa.string()),
                    empty,
                    empty,
                    empty,
                    np.zeros((0, F), np.int64),
                    np.zeros((0, F), np.int64),
                ]
            return [pa.array([], pa.string()), empty, np.zeros(0, np.int32), np.zeros(0, np.int32)]
        keys = pa.concat_arrays([c[0] for c in self._chunks])
        return [keys] + [np.concatenate([c[k] for c in self._chunks]) for k in range(1, len(self._chunks[0]))]

    def finish(self) -> tuple[ShardInfo, np.ndarray]:
        raw_bytes = None
        try:
            if self.shard_format == "tar":
                self._tar.close()
                keys, lengths, offsets, sizes, field_offsets, field_sizes = self._columns()
                offsets = offsets.astype(np.uint64)
                sizes = sizes.astype(np.uint64)
            else:
                self._arrow.close()
                keys, lengths, batch, row = self._columns()
                ranges = np.array(self._arrow.batch_ranges, dtype=np.uint64).reshape(-1, 2)
                b = batch.astype(np.int64)
                offsets = ranges[b, 0] if len(b) else np.zeros(0, np.uint64)
                sizes = ranges[b, 1] if len(b) else np.zeros(0, np.uint64)
            self._raw.flush()
            self._raw.close()
        except BaseException:
            self.abort()
            raise
        n = len(keys)
        lengths = lengths.astype(np.int64)
        idx = ShardIndex(keys, offsets, sizes, lengths)
        if self.shard_format == "tar":
            idx.field_offsets = field_offsets.astype(np.uint32).reshape(n, len(self.fields))
            idx.field_sizes = field_sizes.astype(np.uint64).reshape(n, len(self.fields))
        else:
            idx.batch = batch
            idx.row = row
        # Each checksum covers the bytes as stored: for a compressed Arrow shard, the compressed
        # record batch, so a ranged read is verified before anything decompresses it.
        idx.checksums = range_checksums(self.tmp, offsets, sizes)
        index_bytes = idx.to_bytes([f.name for f in self.fields])
        shard_hash = format_digest(self._hf.h)
        shard_bytes = self._hf.pos
        if self.shard_format == "arrow" and self._arrow.compressed:
            stored = sum(size for _, size in self._arrow.batch_ranges)
            raw_bytes = shard_bytes - stored + self._arrow.raw_bytes
        # Shard first, then its index: an index on disk always describes a complete shard.
        publish(self.tmp, self.final)
        atomic_write_bytes(os.path.join(self.root, self.index_rel), index_bytes)
        self.index_keys = keys
        info = ShardInfo(
            path=self.rel_path,
            samples=n,
            bytes=shard_bytes,
            hash=shard_hash,
            index=self.index_rel,
            index_bytes=len(index_bytes),
            index_hash=hash_bytes(index_bytes),
            raw_bytes=raw_bytes,
        )
        return info, lengths


def _key_array(keys) -> pa.Array:
    if isinstance(keys, pa.ChunkedArray):
        return keys.combine_chunks()
    return keys if isinstance(keys, pa.Array) else pa.array(keys, type=pa.string())


def range_checksums(path: str, offsets: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """xxh3-64 of every (offset, size) byte range of a written file; repeated ranges (Arrow rows
    of one record batch) are hashed once. The file was just written, so this reads page cache."""
    out = np.zeros(len(offsets), dtype=np.uint64)
    if not len(offsets):
        return out
    pairs, inverse = np.unique(
        np.stack([offsets.astype(np.uint64), sizes.astype(np.uint64)], axis=1), axis=0, return_inverse=True
    )
    digests = np.empty(len(pairs), dtype=np.uint64)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
        view = memoryview(mm)
        try:
            for j, (a, n) in enumerate(pairs.tolist()):
                digests[j] = range_checksum(view[a : a + n])
        finally:
            view.release()
    out[:] = digests[inverse.reshape(-1)]
    return out


def publish_manifest(root: str, manifest: Manifest, lengths: np.ndarray) -> bytes:
    """Write ``lengths.npy``, the per-shard summaries, then ``index.json``; the manifest goes last,
    as the commit marker."""
    data = lengths_to_bytes(lengths)
    atomic_write_bytes(os.path.join(root, LENGTHS_NAME), data)
    manifest.lengths_file = {"path": LENGTHS_NAME, "bytes": len(data), "hash": hash_bytes(data)}
    write_summaries(root, manifest, lengths)
    manifest.length = {**manifest.length, "summary": length_summary(lengths)}
    body = manifest.to_json()
    atomic_write_bytes(os.path.join(root, MANIFEST_NAME), body)
    return body


def summaries_bytes(manifest: Manifest, lengths: np.ndarray, *, sketch: bool = True) -> bytes:
    """The ``summaries.arrow`` of a dataset: per-shard counts, token sums and length histograms of
    ``lengths`` (see format.summaries), bound to the manifest's lengths file by its hash; with the
    weight-quantile sketch where node ranges cut shards (``sketch=False``: without, so a dataset
    packed before it keeps its node ranges, and its node caches stay valid)."""
    counts = np.array([s.samples for s in manifest.shards], dtype=np.int64)
    cells = sketch_cells(len(counts)) if sketch else None
    return ShardSummaries.from_lengths(lengths, counts, cells).to_bytes(manifest.lengths_file.get("hash") or "")


def write_summaries(root: str, manifest: Manifest, lengths: np.ndarray) -> None:
    atomic_write_bytes(os.path.join(root, SUMMARIES_NAME), summaries_bytes(manifest, lengths))
