"""Atomic publication of files: unique temp name in the target directory, fsync, rename.

Every file shardtool publishes goes through here, so a reader never sees a half-written
shard, index or manifest, whatever kills the writer.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from typing import IO, Iterator

TMP_PREFIX = ".tmp-"


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
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX + os.path.basename(path) + ".", dir=directory)
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


def make_temp_path(final_path: str) -> str:
    directory = os.path.dirname(os.path.abspath(final_path)) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX + os.path.basename(final_path) + ".", dir=directory)
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
