"""Atomic publication of files: unique temp name in the target directory, fsync, rename.

Every file shardtool publishes goes through here, so a reader never sees a half-written
shard, index or manifest, whatever kills the writer.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from collections.abc import Iterator
from typing import IO

TMP_PREFIX = ".tmp-"
_TEMP_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)


def fsync_path(path: str) -> None:
    """fsync a file or directory by name."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    # The rename is durable only once the directory entry is on disk. Best effort: some
    # filesystems refuse to open or fsync a directory, and the data itself is already synced.
    with contextlib.suppress(OSError):
        fsync_path(path)


@contextlib.contextmanager
def atomic_file(path: str, mode: str = "wb") -> Iterator[IO]:
    """Write ``path`` atomically; on any exception the temp file is removed and nothing appears."""
    directory = os.path.dirname(os.path.abspath(path)) or "."
    fd, tmp = _create_temp(path)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def atomic_write_bytes(path: str, data: bytes) -> None:
    with atomic_file(path, "wb") as f:
        f.write(data)


def publish(tmp_path: str, final_path: str) -> None:
    """Move an already written and closed temp file into place durably."""
    fsync_path(tmp_path)
    os.replace(tmp_path, final_path)
    fsync_dir(os.path.dirname(os.path.abspath(final_path)))


def _create_temp(final_path: str) -> tuple[int, str]:
    """A new, uniquely named file beside ``final_path``: (open descriptor, its path).

    Created with mode 0o666 so the kernel applies the umask (and a directory's default ACL), as
    for any new file: the published file gets the permissions the user's umask gives. mkstemp's
    0600 would survive the rename and make a dataset on a shared filesystem owner-only; reading
    the umask to chmod instead needs ``os.umask``, which changes it process-wide, racing threads.
    """
    directory = os.path.dirname(os.path.abspath(final_path)) or "."
    os.makedirs(directory, exist_ok=True)
    prefix = os.path.join(directory, TMP_PREFIX + os.path.basename(final_path) + ".")
    for _ in range(100):
        tmp = prefix + secrets.token_hex(6)
        try:
            return os.open(tmp, _TEMP_FLAGS, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no unused temporary name", prefix + "*")


def make_temp_path(final_path: str) -> str:
    fd, tmp = _create_temp(final_path)
    os.close(fd)
    return tmp


def remove_stale_temps(directory: str, prefix: str = TMP_PREFIX) -> int:
    """Delete files in ``directory`` whose names start with ``prefix`` (by default, every temp
    file a killed writer left); returns how many were removed. A missing directory, or a file
    that cannot be removed, is skipped silently."""
    n = 0
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(directory):
            if name.startswith(prefix):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(directory, name))
                    n += 1
    return n
