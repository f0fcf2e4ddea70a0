"""Compressed Arrow shards enter the cache plain: decompressed once, on the way in.

A compressed shard (``pack --compression``) is stored small on the shared filesystem, but a
reader of it decompresses a record batch for every sample it reads. The cache therefore fetches
the stored bytes into a temp copy, verifies them against the manifest's hash (as for any shard),
and rewrites the shard as an uncompressed Arrow IPC file with the same record batches, row for
row: the sample index's (batch, row) of every sample stays right, so the loader memory-maps the
plain file exactly as it maps a shard packed plain. The index's byte ranges describe the stored
file; nothing reads them for a cached shard (the loader locates Arrow values from the batches'
buffer addresses, `loader.shardview`), and `CachedDataset` reads a plain shard by batch number.

The plain file's size and hash are recorded at decompression, in ``.shardtool/plain/<shard>``
next to the trust stamps, tied to the manifest's (stored) hash: the stamp, `ensure_shard`'s
re-verification and ``cache verify`` check the plain file against that record. All of it happens
under the shard's exclusive lock, and the plain file is published by rename after its record is
written, so two warmers, or a warmer and a loader's fetch-on-miss, never see a half-written file
and never decompress the same shard at once (the race of Streaming #863 and LitData #463).

Passes over a shard's bytes (measured on a 40 MB zstd / 64 MB plain shard, page cache): the
fetch into the stored copy (a kernel copy from a local source, 20 ms; a remote one is hashed as
it streams in), the hash of that copy (7 ms; none for a remote one), the decompression by Arrow
writing the plain file (110-160 ms, of which 77 ms decompressing), and the plain file's hash (10
ms). Decompression is most of it; which is why the pack writes 1 MiB compressed record batches
(`format.arrowshard.COMPRESSED_BATCH_BYTES`: Arrow makes a zstd context per buffer).
"""

from __future__ import annotations

import contextlib
import json
import os

import pyarrow as pa

from ..format.atomic import fsync_dir
from ..format.decompress import Decompressor
from ..format.errors import FormatError
from ..format.hashing import hash_file
from ..format.manifest import Manifest, ShardInfo
from .errors import SourceCorrupt
from .store import hash_fd, local_fault, new_temp, remove_temps_for, temp_target, write_small

PLAIN, STORED = "plain", "stored"
KEEP_COMPRESSED = "keep-compressed"  # marker in .shardtool/: this node keeps shards compressed


def record_path(vd, shard: int) -> str:
    return os.path.join(vd.meta, "plain", str(shard))


def stored_copy_path(vd, shard: int) -> str:
    """Where the verified stored (compressed) bytes wait for their decompression."""
    return os.path.join(vd.meta, "stored", str(shard))


def stored_shard_of(name: str) -> int | None:
    """The shard a file of the stored folder (a stored copy or its temp) is for; None for others."""
    base = temp_target(name) or name
    return int(base) if base.isdigit() else None


def read_record(vd, shard: int, info: ShardInfo) -> dict | None:
    """The plain file's recorded size and hash, if recorded for this very stored shard."""
    try:
        with open(record_path(vd, shard)) as f:
            rec = json.loads(f.read())
    except (OSError, ValueError):
        return None
    if not isinstance(rec, dict) or rec.get("stored_hash") != info.hash or not isinstance(rec.get("bytes"), int):
        return None
    return rec


def wants_plain(manifest: Manifest, keep_compressed: bool) -> bool:
    return manifest.compression is not None and manifest.shard_format == "arrow" and not keep_compressed


def cached_size(manifest: Manifest, info: ShardInfo, keep_compressed: bool) -> int:
    """Bytes ``info`` will take in the cache (the manifest's uncompressed size where it is
    decompressed: pack records it within a few hundred bytes of the plain file's size)."""
    if wants_plain(manifest, keep_compressed) and info.raw_bytes:
        return int(info.raw_bytes)
    return info.bytes


def keeps_compressed(vd) -> bool:
    """Whether the last warm of this version asked to keep shards compressed (fetch-on-miss follows it)."""
    return os.path.exists(os.path.join(vd.meta, KEEP_COMPRESSED))


def mark_keep_compressed(vd, keep: bool) -> None:
    path = os.path.join(vd.meta, KEEP_COMPRESSED)
    if keep:
        if not os.path.exists(path):
            write_small(path, b"warm --keep-compressed\n", perms=vd.perms)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def found_intact(vd, shard: int, info: ShardInfo, path: str) -> tuple[str | None, dict | None]:
    """(form, plain record) of the file at ``path`` if it is the stored shard or its recorded
    plain form, hashed now; (None, None) if it is neither."""
    try:
        size = os.path.getsize(path)
    except OSError:
        return None, None
    rec = read_record(vd, shard, info)
    if size != info.bytes and (rec is None or rec["bytes"] != size):
        return None, None
    try:
        digest = hash_file(path)[0]
    except OSError:
        return None, None
    if size == info.bytes and digest == info.hash:
        return STORED, None
    if rec is not None and rec["bytes"] == size and rec.get("hash") == digest:
        return PLAIN, rec
    return None, None


def remove_leftovers(vd, shard: int, final_path: str) -> int:
    """Remove a killed holder's temps of this shard and its stored copy; returns the files removed.
    Only the holder of its lock may call this."""
    stored = stored_copy_path(vd, shard)
    n = sum(remove_temps_for(path) for path in (final_path, stored))
    with contextlib.suppress(FileNotFoundError):
        os.unlink(stored)
        n += 1
    return n


def decompress(vd, shard: int, info: ShardInfo, stored_path: str, final_path: str, *, fsync: bool) -> dict:
    """Rewrite the verified stored shard at ``stored_path`` as a plain Arrow IPC file at
    ``final_path`` (temp, record, rename); returns the record. Caller holds the shard's lock."""
    what = f"shard {info.path}"
    fd, tmp = new_temp(final_path, what, vd.perms)
    os.close(fd)
    try:
        batches = _rewrite(stored_path, tmp, info)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            rec = {
                "stored_hash": info.hash,
                "stored_bytes": info.bytes,
                "bytes": size,
                "hash": hash_fd(fd, size),
                "batches": batches,
            }
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        # Record first: a plain file in place always has its record (a record without its
        # file, after a crash here, is harmless: it names a hash no file has).
        write_small(record_path(vd, shard), json.dumps(rec).encode(), perms=vd.perms)
        os.replace(tmp, final_path)
        if fsync:
            fsync_dir(os.path.dirname(final_path))
        return rec
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise local_fault(e, what) from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _rewrite(stored_path: str, tmp: str, info: ShardInfo) -> int:
    """Same record batches, same rows, buffers uncompressed; returns the number of batches."""
    try:
        with pa.memory_map(stored_path) as stored, pa.OSFile(tmp, "wb") as sink:
            rows = Decompressor(stored, f"shard {info.path}").write_plain(sink)
        with pa.memory_map(tmp) as plain:
            check = Decompressor(plain, f"shard {info.path} (its plain copy)")
            kept = check.count == len(rows) and all(check.batch(k).num_rows == n for k, n in enumerate(rows))
        if not kept:
            raise SourceCorrupt(f"shard {info.path}: its plain copy does not keep the stored record batches")
        return len(rows)
    except FormatError as e:
        # The bytes matched the manifest's hash: the shard was written this way.
        raise SourceCorrupt(f"{e}; its bytes match the manifest's hash, so it was packed so") from None
