"""Copying between two local files inside the kernel, as ``cp`` does.

A read/write loop moves every byte through a Python buffer (two copies, plus allocating page
cache for the writes under the GIL); ``copy_file_range`` (or a server-side copy on NFS/CIFS,
a reflink where the filesystem offers one) and ``sendfile`` move them once, in the kernel.
Each is tried in turn, because which one works depends on the kernel and on the two
filesystems: copy_file_range across filesystems is refused by many kernels (EXDEV), sendfile to
a regular file needs Linux >= 2.6.33, and the plain loop works everywhere.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable

STEP = 64 << 20  # bytes per call: big enough to be efficient, small enough for progress and timeouts

# The method cannot copy between these two files at all; the next one may.
UNSUPPORTED = {
    errno.EXDEV,
    errno.EINVAL,
    errno.ENOSYS,
    errno.EOPNOTSUPP,
    errno.ENOTSUP,
    errno.EBADF,
    errno.ETXTBSY,
    errno.EPERM,
}
# The destination side cannot take the bytes; no retry or other method helps.
DEST_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG}


class DestinationError(OSError):
    """Writing the copy failed on the destination's side (full, read-only, over quota)."""


def _cfr(src_fd: int, dst_fd: int, off: int, n: int) -> int:
    return os.copy_file_range(src_fd, dst_fd, n, off, off)


def _sendfile(src_fd: int, dst_fd: int, off: int, n: int) -> int:
    os.lseek(dst_fd, off, os.SEEK_SET)
    return os.sendfile(dst_fd, src_fd, off, n)


def _readwrite(src_fd: int, dst_fd: int, off: int, n: int) -> int:
    data = os.pread(src_fd, min(n, 16 << 20), off)
    mv = memoryview(data)
    at = off
    while mv:
        w = os.pwrite(dst_fd, mv, at)
        mv, at = mv[w:], at + w
    return len(data)


METHODS: list[tuple[str, Callable[[int, int, int, int], int]]] = []
if hasattr(os, "copy_file_range"):
    METHODS.append(("copy_file_range", _cfr))
if hasattr(os, "sendfile"):
    METHODS.append(("sendfile", _sendfile))
METHODS.append(("read/write", _readwrite))


def copy_range(
    src_fd: int, dst_fd: int, size: int, *, on_step: Callable[[int], None] | None = None, methods=None
) -> int:
    """Copy ``size`` bytes from offset 0 of ``src_fd`` to offset 0 of ``dst_fd``; returns the bytes
    copied, fewer only if the source ended early. ``on_step(n)`` after every step (progress, and
    a place to raise on a deadline). Destination faults raise :class:`DestinationError`; other
    errors (a failing source) propagate as they are. ``methods``: the ones to try, in order."""
    methods = METHODS if methods is None else methods
    done = 0
    m = 0
    while done < size:
        name, method = methods[m]
        try:
            n = method(src_fd, dst_fd, done, min(STEP, size - done))
        except OSError as e:
            if e.errno in DEST_FULL:
                raise DestinationError(e.errno, e.strerror) from None
            if e.errno in UNSUPPORTED and m + 1 < len(methods):
                m += 1  # the next method resumes at ``done``: these calls write at explicit offsets
                continue
            raise
        if n == 0:
            # End of the source, or a method that silently copies nothing (copy_file_range on
            # some kernels and filesystems); only when the plain read agrees is it the end.
            if m + 1 < len(methods):
                m += 1
                continue
            break
        done += n
        if on_step is not None:
            on_step(n)
    return done
