"""The two edges of a transfer: reading the source through fsspec and publishing into the cache.

A shard is copied into a temp file next to its final name (in the kernel from a local source, in
large sequential reads hashed on the way from a remote one), checked against the manifest (size,
then hash), fsynced if asked (:mod:`shardtool.cache.durability`) and renamed. Errors on the
source side are retried by :mod:`shardtool.cache.retry`; errors on the local side (disk full, read-only,
permissions) become :class:`LocalFault` at once, because retrying cannot fix them.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import posixpath
import threading
import time
from collections.abc import Callable

import fsspec

from ..format.atomic import TMP_PREFIX, fsync_dir
from ..format.dataset import is_local
from ..format.hashing import format_digest, hash_bytes, hash_fileobj, new_hasher
from ..format.manifest import ShardInfo
from ..format.nodeshare import shared_read
from ..format.storage import cat_whole, past_end, share_key, store_fs
from .errors import LocalFault, SourceCorrupt, SourceUnavailable
from .kcopy import DestinationError, copy_range
from .perms import DEFAULT_PERMS, Perms
from .retry import RetryPolicy, call_with_timeout, with_retries

CHUNK = 16 << 20


class ShortRead(OSError):
    """The source ended before the manifest's size: a dropped connection, worth a retry."""


class HashMismatch(OSError):
    """The bytes read disagree with the manifest's hash: maybe damaged in transit, so worth a
    refetch; when every attempt disagrees, :func:`copy_shard` calls the source corrupt."""


def local_fault(e: OSError, what: str) -> LocalFault:
    fault = LocalFault(f"cache write failed for {what}: {e.strerror or e} ({type(e).__name__}, errno {e.errno})")
    fault.errno = e.errno  # EACCES/EROFS: a cache this process may only read (see cache.dcache)
    return fault


class Origin:
    """A dataset root on any fsspec filesystem: where the node cache copies from."""

    def __init__(self, url: str, storage_options: dict | None = None, *, fs=None, root: str | None = None):
        self.url = url
        if fs is None:
            # An unknown protocol stays fsspec's ValueError, which the warm and the loader's cache handle.
            fs, root = store_fs(url, storage_options)
        self.fs = fs
        self.root = (root or "").rstrip("/")
        self.local = is_local(fs)

    def path(self, rel: str) -> str:
        return posixpath.join(self.root, rel) if self.root else rel

    def read_bytes(self, rel: str, *, policy: RetryPolicy, deadline: float | None = None) -> bytes:
        """A whole small file (manifest, summaries, an index): read once per node for a job's ranks
        (`shardtool.format.nodeshare`), with retries."""
        path = self.path(rel)
        if self.local:  # a local read cannot be abandoned usefully; no watchdog thread per file
            return shared_read(
                share_key(self.fs, path),
                lambda: with_retries(lambda t: self.fs.cat_file(path), what=path, policy=policy, deadline=deadline),
                local=True,
            )
        return shared_read(
            share_key(self.fs, path),
            lambda: with_retries(
                lambda t: call_with_timeout(lambda: cat_whole(self.fs, path), _min(t, policy.stall_timeout)),
                what=path,
                policy=policy,
                deadline=deadline,
            ),
        )

    def holding(self, info: ShardInfo) -> Origin:
        """The source of shard ``info``'s bytes: this one, or, for a tar indexed in place, the
        place its manifest entry names (format.storage.shard_location)."""
        if info.source is None:
            return self
        from ..format.storage import shard_location

        fs, path = shard_location(self.fs, self.root, info)
        return _OneFile(fs, path)

    def open_stream(self, rel: str, size: int):
        """A remote object of ``size`` bytes (the manifest's) for sequential reading (local files
        are copied by :mod:`shardtool.cache.kcopy`). Opened as one byte longer: its size is then
        not asked (a HEAD before the first GET), and a larger object shows in the last read, which
        asks one byte past the end; an object of the right size answers it short."""
        path = self.path(rel)
        # No read-ahead cache: every read is one large ranged request, nothing read twice.
        try:
            f = self.fs.open(path, "rb", block_size=CHUNK, cache_type="none", size=size + 1)
        except TypeError:  # a filesystem whose files take no size: it asks for one
            return self.fs.open(path, "rb", block_size=CHUNK, cache_type="none")
        if isinstance(f, fsspec.spec.AbstractBufferedFile):
            # s3fs's reads ask the object's details (a HEAD) to compare its ETag between reads;
            # the copy's hash is checked against the manifest instead.
            f.details = {"name": path, "size": size + 1, "type": "file"}
        return f


class _OneFile(Origin):
    """A shard held outside its dataset: every ``path`` is its one path."""

    def __init__(self, fs, path: str):
        super().__init__(path, fs=fs, root="")
        self._file = path

    def path(self, rel: str) -> str:
        return self._file


def _min(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None else min(a, b)


def temp_path_for(final_path: str) -> str:
    """The one temp name of a target. Only the holder of the target's exclusive lock writes it,
    so a fixed name is safe, and a dead holder's leftover is found without listing the directory
    (a listing per shard would make a warm of n shards in one directory cost n**2)."""
    d, base = os.path.split(final_path)
    return os.path.join(d, TMP_PREFIX + base + ".part")


def temp_target(name: str) -> str | None:
    """The file name a temp (`temp_path_for`'s, or a small file's) is written for; None for a
    name that is no temp."""
    if not name.startswith(TMP_PREFIX):
        return None
    return name[len(TMP_PREFIX) :].rsplit(".", 1)[0]


def remove_temps_for(final_path: str) -> bool:
    """Delete a killed writer's temp of this one target (whether there was one); only the holder
    of its lock may call this."""
    try:
        os.unlink(temp_path_for(final_path))
    except FileNotFoundError:
        return False
    return True


def new_temp(final_path: str, what: str, perms: Perms) -> tuple[int, str]:
    tmp = temp_path_for(final_path)
    try:
        perms.makedirs(os.path.dirname(tmp))
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, perms.mode)
    except OSError as e:
        raise local_fault(e, what) from None
    try:
        perms.set_fd(fd)  # before any byte lands: the published file never had other permissions
    except OSError as e:
        os.close(fd)
        raise local_fault(e, what) from None
    return fd, tmp


WRITEBACK_EVERY = 8 << 20
_FADVISE = getattr(os, "posix_fadvise", None)


def _start_writeback(fd: int, offset: int, length: int) -> None:
    # On Linux, DONTNEED on a dirty range starts its writeback now, so the fsync before the
    # rename has little left to wait for and disk writes overlap the copy (as `cp; sync` would
    # not); elsewhere it is at worst a no-op.
    if _FADVISE is not None:
        with contextlib.suppress(OSError):
            _FADVISE(fd, offset, length, os.POSIX_FADV_DONTNEED)


def hash_fd(fd: int, size: int, *, use_mmap: bool = True) -> str:
    """Hash what the temp file holds, i.e. exactly the bytes that will be published; they were
    just written, so this reads the page cache, not the disk."""
    if use_mmap and size:
        with contextlib.suppress(OSError, ValueError):  # a filesystem without mmap (some FUSE mounts)
            with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as m:
                return hash_bytes(m)
    os.lseek(fd, 0, os.SEEK_SET)
    with open(fd, "rb", closefd=False) as f:
        return hash_fileobj(f)[0]


def _write_all(fd: int, data) -> None:
    mv = memoryview(data)
    while mv:
        mv = mv[os.write(fd, mv) :]


def _copy_local(src: Origin, info: ShardInfo, fd: int, what: str, progress: Callable[[int], None]) -> str:
    """Local source: copy in the kernel (as cp does), then hash the copy. Returns its digest."""
    sfd = os.open(src.path(info.path), os.O_RDONLY)  # missing: FileNotFoundError, a 404 to the retry layer
    try:
        if os.fstat(sfd).st_size > info.bytes:
            raise SourceCorrupt(f"{what}: source is larger than the manifest's {info.bytes} bytes")
        try:
            n = copy_range(sfd, fd, info.bytes, on_step=progress)
        except DestinationError as e:
            raise local_fault(e, what) from None
    finally:
        os.close(sfd)
    if n < info.bytes:
        raise ShortRead(f"{what}: source ended after {n} of {info.bytes} bytes")
    return hash_fd(fd, info.bytes)


def _copy_stream(
    src: Origin,
    info: ShardInfo,
    fd: int,
    what: str,
    began: float,
    timeout: float | None,
    stall: float | None,
    progress: Callable[[int], None],
    fsync: bool,
) -> str:
    """Remote (or any fsspec) source: large sequential reads, hashed on the way. Returns the digest."""
    h = new_hasher()
    counted = written_back = 0
    with src.open_stream(info.path, info.bytes) as f:
        while True:
            left = None if timeout is None else timeout - (time.monotonic() - began)
            data = call_with_timeout(lambda: _read_chunk(f), _min(stall, left))
            n = len(data)
            if not n:
                break
            counted += n
            if counted > info.bytes:
                raise SourceCorrupt(f"{what}: source is larger than the manifest's {info.bytes} bytes")
            h.update(data)
            try:
                _write_all(fd, data)
            except OSError as e:
                raise local_fault(e, what) from None
            if fsync and counted - written_back >= WRITEBACK_EVERY:
                _start_writeback(fd, written_back, counted - written_back)
                written_back = counted
            progress(n)
            if counted == info.bytes:
                break  # all of it, and the last read asked one byte more (open_stream): nothing more
    if counted < info.bytes:
        raise ShortRead(f"{what}: source ended after {counted} of {info.bytes} bytes")
    return format_digest(h)


def _read_chunk(f) -> bytes:
    try:
        return f.read(CHUNK)
    except OSError as e:
        if past_end(e):  # the byte past the end of an object of exactly CHUNKs (open_stream)
            return b""
        raise


def _copy_once(
    src: Origin,
    info: ShardInfo,
    final_path: str,
    timeout: float | None,
    stall: float | None,
    on_bytes: Callable[[int], None] | None,
    fsync: bool,
    perms: Perms,
) -> None:
    what = f"shard {info.path}"
    fd, tmp = new_temp(final_path, what, perms)
    counted = 0
    began = time.monotonic()

    def progress(n: int) -> None:
        # after every chunk, on either path: the place to give up on an attempt past its time
        nonlocal counted
        counted += n
        if on_bytes is not None:
            on_bytes(n)
        if timeout is not None and time.monotonic() - began > timeout:
            raise TimeoutError(f"{what}: attempt exceeded {timeout:.1f}s")

    try:
        if src.local:
            digest = _copy_local(src, info, fd, what, progress)
        else:
            digest = _copy_stream(src, info, fd, what, began, timeout, stall, progress, fsync)
        if digest != info.hash:
            raise HashMismatch(f"{what}: source content hash {digest} does not match the manifest's {info.hash}")
        try:
            if fsync:
                os.fsync(fd)
            os.close(fd)
            fd = -1
            # Safe to publish unsynced: see cache.durability (the stamp records it).
            os.replace(tmp, final_path)
            if fsync:
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


def copy_shard(
    src: Origin,
    info: ShardInfo,
    final_path: str,
    *,
    policy: RetryPolicy,
    deadline: float | None = None,
    on_bytes: Callable[[int], None] | None = None,
    on_retry=None,
    fsync: bool = True,
    perms: Perms = DEFAULT_PERMS,
) -> None:
    """Fetch one shard into ``final_path``, verified and atomic, retrying transient failures;
    ``fsync``: make it durable before the rename (else see :mod:`shardtool.cache.durability`)."""
    src = src.holding(info)
    stall = None if src.local else policy.stall_timeout
    try:
        with_retries(
            lambda t: _copy_once(src, info, final_path, t, stall, on_bytes, fsync, perms),
            what=f"shard {info.path} ({src.path(info.path)})",
            policy=policy,
            deadline=deadline,
            on_retry=on_retry,
        )
    except SourceUnavailable as e:
        if isinstance(e.__cause__, HashMismatch):
            raise SourceCorrupt(
                f"{e.__cause__} on each of {policy.attempts} fetches; the source shard is corrupt "
                f"({src.path(info.path)})"
            ) from None
        raise


def store_verified(
    path: str, data: bytes, *, size: int | None, digest: str | None, what: str, perms: Perms = DEFAULT_PERMS
) -> None:
    """Write small metadata (manifest, lengths, index) atomically after checking it."""
    if size is not None and len(data) != size:
        raise SourceCorrupt(f"{what}: source has {len(data)} bytes, the manifest says {size}")
    if digest and hash_bytes(data) != digest:
        raise SourceCorrupt(f"{what}: source content does not match the hash in the manifest")
    try:
        write_small(path, data, perms=perms)
    except OSError as e:
        raise local_fault(e, what) from None


def write_small(path: str, data: bytes, *, perms: Perms = DEFAULT_PERMS, durable: bool = False) -> None:
    """Atomic, with the cache's permissions; not fsynced unless ``durable``: small files are
    re-verified against the manifest on every read, so one lost in a crash is refetched, and
    1,000s of fsyncs would dominate a warm of small shards."""
    d, base = os.path.split(path)
    # Unique per writer (writers of one index may race without a lock, from processes in other
    # PID namespaces too), and cheaper than mkstemp; a killed writer's leftover goes at `cache gc`.
    tmp = os.path.join(d, f"{TMP_PREFIX}{base}.{os.getpid()}-{threading.get_ident()}-{os.urandom(4).hex()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, perms.mode)
    except FileNotFoundError:
        perms.makedirs(d)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, perms.mode)
    try:
        try:
            perms.set_fd(fd)
            _write_all(fd, data)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        if durable:
            fsync_dir(d)
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
