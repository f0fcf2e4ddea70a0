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

from .arrowshard import ArrowShardWriter
from .atomic import atomic_write_bytes, make_temp_path, publish
from .fields import FieldSpec, encode
from .hashing import format_digest, hash_bytes, new_hasher, range_checksum
from .manifest import LENGTHS_NAME, MANIFEST_NAME, Manifest, ShardInfo, lengths_to_bytes, length_summary
from .sindex import ShardIndex
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
    """Writes one shard (tar or arrow) + its sample index under ``root/rel_path``."""

    def __init__(self, root: str, rel_path: str, shard_format: str, fields: list[FieldSpec]):
        self.root = root
        self.rel_path = rel_path
        self.index_rel = rel_path.rsplit(".", 1)[0] + ".idx.arrow"
        self.shard_format = shard_format
        self.fields = fields
        self.final = os.path.join(root, rel_path)
        self.tmp = make_temp_path(self.final)
        self._raw = open(self.tmp, "wb", buffering=WRITE_BUFFER)
        self._hf = _HashingFile(self._raw)
        self.keys: list[str] = []
        self.offsets: list[int] = []
        self.sizes: list[int] = []
        self.lengths: list[int] = []
        self.field_offsets: list[list[int]] = []
        self.field_sizes: list[list[int]] = []
        self.batch: list[int] = []
        self.row: list[int] = []
        # Tar samples added in blocks keep their index columns as arrays, in order with the
        # per-sample lists above (flushed into a chunk whenever a block follows them).
        self._chunks: list[tuple[np.ndarray, ...]] = []
        if shard_format == "tar":
            self._tar = TarShardWriter(self._hf, [f.ext for f in fields])
        else:
            self._arrow = ArrowShardWriter(self._hf, fields)

    def add(self, key: str, values: list[Any], length: int, approx_bytes: int | None = None) -> int:
        """Append a sample (values in ``fields`` order); returns its byte size in the shard (tar)."""
        self.keys.append(key)
        self.lengths.append(length)
        if self.shard_format == "tar":
            payloads = [encode(spec, v) for spec, v in zip(self.fields, values)]
            e = self._tar.write(key, payloads)
            self.offsets.append(e.offset)
            self.sizes.append(e.size)
            self.field_offsets.append(e.field_offsets)
            self.field_sizes.append(e.field_sizes)
            return e.size
        size = approx_bytes if approx_bytes is not None else 0
        b, r = self._arrow.write(key, values, size)
        self.batch.append(b)
        self.row.append(r)
        return size

    def add_encoded(self, key: str, values: list[Any], payloads: list[bytes], length: int) -> None:
        """Append a sample whose tar payloads the caller already encoded (the packer's hot path)."""
        self.keys.append(key)
        self.lengths.append(length)
        if self.shard_format == "tar":
            offset, size, field_offsets, field_sizes = self._tar.write_fast(key, payloads)
            self.offsets.append(offset)
            self.sizes.append(size)
            self.field_offsets.append(field_offsets)
            self.field_sizes.append(field_sizes)
        else:
            b, r = self._arrow.write(key, values, sum(len(p) for p in payloads))
            self.batch.append(b)
            self.row.append(r)

    def add_tar_block(self, data, keys: list[str], offsets: np.ndarray, field_offsets: np.ndarray,
                      field_sizes: np.ndarray, lengths: np.ndarray) -> None:
        """Append consecutive samples whose tar members the caller laid out in ``data``.

        ``offsets`` (n + 1,) are the sample boundaries relative to ``data``'s start;
        ``field_offsets`` / ``field_sizes`` are (n, F) as in the sample index. One large write
        (and one hash update) instead of one per sample.
        """
        base = self._tar.write_block(data)
        self._flush_rows()
        self.keys.extend(keys)
        self._chunks.append((offsets[:-1] + base, np.diff(offsets), lengths, field_offsets, field_sizes))

    def _flush_rows(self) -> None:
        if not self.offsets:
            return
        F = len(self.fields)
        self._chunks.append((np.array(self.offsets, dtype=np.int64), np.array(self.sizes, dtype=np.int64),
                             np.array(self.lengths, dtype=np.int64),
                             np.array(self.field_offsets, dtype=np.int64).reshape(-1, F),
                             np.array(self.field_sizes, dtype=np.int64).reshape(-1, F)))
        for column in (self.offsets, self.sizes, self.lengths, self.field_offsets, self.field_sizes):
            column.clear()

    def abort(self) -> None:
        try:
            self._raw.close()
        finally:
            try:
                os.unlink(self.tmp)
            except OSError:
                pass

    def finish(self) -> tuple[ShardInfo, np.ndarray]:
        try:
            if self.shard_format == "tar":
                self._tar.close()
                self._flush_rows()
                F = len(self.fields)
                chunks = self._chunks or [(np.zeros(0, np.int64),) * 3 + (np.zeros((0, F), np.int64),) * 2]
                offsets, sizes, tar_lengths, field_offsets, field_sizes = (
                    np.concatenate([c[k] for c in chunks]) for k in range(5))
                offsets = offsets.astype(np.uint64)
                sizes = sizes.astype(np.uint64)
            else:
                self._arrow.close()
                ranges = np.array(self._arrow.batch_ranges, dtype=np.uint64).reshape(-1, 2)
                b = np.array(self.batch, dtype=np.int64)
                offsets = ranges[b, 0] if len(b) else np.zeros(0, np.uint64)
                sizes = ranges[b, 1] if len(b) else np.zeros(0, np.uint64)
            self._raw.flush()
            self._raw.close()
        except BaseException:
            self.abort()
            raise
        n = len(self.keys)
        if self.shard_format == "tar":
            lengths = tar_lengths.astype(np.int64)
        else:
            lengths = np.array(self.lengths, dtype=np.int64)
        idx = ShardIndex(self.keys, offsets, sizes, lengths)
        if self.shard_format == "tar":
            idx.field_offsets = field_offsets.astype(np.uint32).reshape(n, len(self.fields))
            idx.field_sizes = field_sizes.astype(np.uint64).reshape(n, len(self.fields))
        else:
            idx.batch = np.array(self.batch, dtype=np.int32)
            idx.row = np.array(self.row, dtype=np.int32)
        idx.checksums = range_checksums(self.tmp, offsets, sizes)
        index_bytes = idx.to_bytes([f.name for f in self.fields])
        shard_hash = format_digest(self._hf.h)
        shard_bytes = self._hf.pos
        # Shard first, then its index: an index on disk always describes a complete shard.
        publish(self.tmp, self.final)
        atomic_write_bytes(os.path.join(self.root, self.index_rel), index_bytes)
        info = ShardInfo(
            path=self.rel_path,
            samples=n,
            bytes=shard_bytes,
            hash=shard_hash,
            index=self.index_rel,
            index_bytes=len(index_bytes),
            index_hash=hash_bytes(index_bytes),
        )
        return info, lengths


def range_checksums(path: str, offsets: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """xxh3-64 of every (offset, size) byte range of a written file; repeated ranges (Arrow rows
    of one record batch) are hashed once. The file was just written, so this reads page cache."""
    out = np.zeros(len(offsets), dtype=np.uint64)
    if not len(offsets):
        return out
    pairs, inverse = np.unique(np.stack([offsets.astype(np.uint64), sizes.astype(np.uint64)], axis=1),
                               axis=0, return_inverse=True)
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


def write_summaries(root: str, manifest: Manifest, lengths: np.ndarray) -> None:
    """``summaries.arrow``: per-shard counts, token sums and length histograms (see format.summaries)."""
    counts = np.array([s.samples for s in manifest.shards], dtype=np.int64)
    summaries = ShardSummaries.from_lengths(lengths, counts)
    atomic_write_bytes(os.path.join(root, SUMMARIES_NAME), summaries.to_bytes(manifest.lengths_file["hash"]))
