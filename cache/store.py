"""The two edges of a transfer: reading the source through fsspec and publishing into the cache.

A shard is streamed in large sequential reads into a temp file next to its final name, hashed
on the way, checked against the manifest (size, then hash), fsynced and renamed. Errors on the
source side are retried by :mod:`cache.retry`; errors on the local side (disk full, read-only,
permissions) become :class:`LocalFault` at once, because retrying cannot fix them.
"""
from __future__ import annotations

import contextlib
import glob
import os
import posixpath
import tempfile
import time
from typing import Callable

import fsspec

from shardtool.format.atomic import TMP_PREFIX, fsync_dir
from shardtool.format.dataset import is_local
from shardtool.format.hashing import format_digest, hash_bytes, new_hasher
from shardtool.format.manifest import ShardInfo

from .errors import LocalFault, SourceCorrupt, SourceUnavailable
from .retry import RetryPolicy, call_with_timeout, with_retries

CHUNK = 16 << 20


class ShortRead(OSError):
    """The source ended before the manifest's size: a dropped connection, worth a retry."""


class HashMismatch(OSError):
    """The bytes read disagree with the manifest's hash: maybe damaged in transit, so worth a
    refetch; when every attempt disagrees, :func:`copy_shard` calls the source corrupt."""


def local_fault(e: OSError, what: str) -> LocalFault:
    return LocalFault(f"cache write failed for {what}: {e.strerror or e} ({type(e).__name__}, errno {e.errno})")


class Source:
    """A dataset root on any fsspec filesystem."""

    def __init__(self, url: str, storage_options: dict | None = None, *, fs=None, root: str | None = None):
        self.url = url
        if fs is None:
            fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        self.fs = fs
        self.root = (root or "").rstrip("/")
        self.local = is_local(fs)

    def path(self, rel: str) -> str:
        return posixpath.join(self.root, rel) if self.root else rel

    def read_bytes(self, rel: str, *, policy: RetryPolicy, deadline: float | None = None) -> bytes:
        path = self.path(rel)
        stall = None if self.local else policy.stall_timeout
        return with_retries(lambda t: call_with_timeout(lambda: self.fs.cat_file(path), _min(t, stall)),
                            what=path, policy=policy, deadline=deadline)

    def open_stream(self, rel: str):
        path = self.path(rel)
        if self.local:
            return open(path, "rb", buffering=0)
        # No read-ahead cache: every read is one large ranged request, nothing read twice.
        return self.fs.open(path, "rb", block_size=CHUNK, cache_type="none")


def _min(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None else min(a, b)


def remove_temps_for(final_path: str) -> int:
    """Delete temp files of this one target; only the holder of its lock may call this."""
    d, base = os.path.split(final_path)
    n = 0
    for p in glob.glob(os.path.join(glob.escape(d), glob.escape(TMP_PREFIX + base + ".")) + "*"):
        with contextlib.suppress(OSError):
            os.unlink(p)
            n += 1
    return n


def _new_temp(final_path: str, what: str) -> tuple[int, str]:
    d, base = os.path.split(final_path)
    try:
        os.makedirs(d, exist_ok=True)
        return tempfile.mkstemp(prefix=TMP_PREFIX + base + ".", dir=d)
    except OSError as e:
        raise local_fault(e, what) from None


WRITEBACK_EVERY = 8 << 20
_FADVISE = getattr(os, "posix_fadvise", None)


def _start_writeback(fd: int, offset: int, length: int) -> None:
    # On Linux, DONTNEED on a dirty range starts its writeback now, so the fsync before the
    # rename has little left to wait for and disk writes overlap the copy (as `cp; sync` would
    # not); elsewhere it is at worst a no-op.
    if _FADVISE is not None:
        with contextlib.suppress(OSError):
            _FADVISE(fd, offset, length, os.POSIX_FADV_DONTNEED)


def _copy_once(src: Source, info: ShardInfo, final_path: str, timeout: float | None,
               stall: float | None, on_bytes: Callable[[int], None] | None) -> None:
    what = f"shard {info.path}"
    fd, tmp = _new_temp(final_path, what)
    counted = 0
    try:
        began = time.monotonic()
        h = new_hasher()
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        written_back = 0
        with src.open_stream(info.path) as f:
            while True:
                if timeout is not None and time.monotonic() - began > timeout:
                    raise TimeoutError(f"{what}: attempt exceeded {timeout:.1f}s")
                if src.local:
                    n = f.readinto(buf)
                    data = view[:n]
                else:
                    left = None if timeout is None else timeout - (time.monotonic() - began)
                    data = call_with_timeout(lambda: f.read(CHUNK), _min(stall, left))
                    n = len(data)
                if not n:
                    break
                counted += n
                if counted > info.bytes:
                    raise SourceCorrupt(f"{what}: source is larger than the manifest's {info.bytes} bytes")
                h.update(data)
                try:
                    mv = memoryview(data)
                    while mv:
                        w = os.write(fd, mv)
                        mv = mv[w:]
                except OSError as e:
                    raise local_fault(e, what) from None
                if counted - written_back >= WRITEBACK_EVERY:
                    _start_writeback(fd, written_back, counted - written_back)
                    written_back = counted
                if on_bytes is not None:
                    on_bytes(n)
        if counted < info.bytes:
            raise ShortRead(f"{what}: source ended after {counted} of {info.bytes} bytes")
        digest = format_digest(h)
        if digest != info.hash:
            raise HashMismatch(f"{what}: source content hash {digest} does not match the manifest's {info.hash}")
        try:
            os.fsync(fd)
            os.close(fd)
            fd = -1
            os.replace(tmp, final_path)
            fsync_dir(os.path.dirname(final_path))
        except OSError as e:
            raise local_fault(e, what) from None
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if on_bytes is not None and counted:
            on_bytes(-counted)  # progress shows bytes that landed, not bytes retried
        raise


def copy_shard(src: Source, info: ShardInfo, final_path: str, *, policy: RetryPolicy,
               deadline: float | None = None, on_bytes: Callable[[int], None] | None = None,
               on_retry=None) -> None:
    """Fetch one shard into ``final_path``, verified and atomic, retrying transient failures."""
    stall = None if src.local else policy.stall_timeout
    try:
        with_retries(lambda t: _copy_once(src, info, final_path, t, stall, on_bytes),
                     what=f"shard {info.path} ({src.path(info.path)})", policy=policy, deadline=deadline,
                     on_retry=on_retry)
    except SourceUnavailable as e:
        if isinstance(e.__cause__, HashMismatch):
            raise SourceCorrupt(f"{e.__cause__} on each of {policy.attempts} fetches; the source shard is corrupt "
                                f"({src.path(info.path)})") from None
        raise


def store_verified(path: str, data: bytes, *, size: int | None, digest: str | None, what: str) -> None:
    """Write small metadata (manifest, lengths, index) atomically after checking it."""
    if size is not None and len(data) != size:
        raise SourceCorrupt(f"{what}: source has {len(data)} bytes, the manifest says {size}")
    if digest and hash_bytes(data) != digest:
        raise SourceCorrupt(f"{what}: source content does not match the hash in the manifest")
    try:
        write_small(path, data)
    except OSError as e:
        raise local_fault(e, what) from None


def write_small(path: str, data: bytes) -> None:
    """Atomic but not fsynced: small files are re-verified against the manifest on every read,
    so one lost in a crash is refetched, and 1,000s of fsyncs would dominate a warm of small shards."""
    d = os.path.dirname(path)
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX + os.path.basename(path) + ".", dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_verified_local(path: str, *, size: int | None, digest: str | None) -> bytes | None:
    """The cached copy of a small file if it matches the manifest, else None."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    if size is not None and len(data) != size:
        return None
    if digest and hash_bytes(data) != digest:
        return None
    return data
