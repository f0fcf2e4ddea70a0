"""Per-shard ``flock`` locks: exclusive to fetch or evict a shard, shared to read it.

``flock`` locks belong to an open file description, so the kernel releases them when the holder
dies (even by SIGKILL): a stale lock file is just a file, never a stuck lock. Two threads of one
process using separate descriptors exclude each other too, which is what the warmer's threads need.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from typing import Iterator


def _open(path: str) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)


def _acquire(fd: int, mode: int, timeout: float | None) -> bool:
    if timeout is None:
        fcntl.flock(fd, mode)
        return True
    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return True
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


@contextlib.contextmanager
def locked(path: str, *, shared: bool = False, timeout: float | None = None) -> Iterator[bool]:
    """Hold the lock on ``path`` for the block; yields False (not held) if ``timeout`` ran out."""
    fd = _open(path)
    try:
        held = _acquire(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX, timeout)
        yield held
    finally:
        os.close(fd)  # closing the descriptor releases the lock


@contextlib.contextmanager
def try_exclusive(path: str) -> Iterator[bool]:
    """Exclusive lock without waiting: False means someone is fetching or reading the shard."""
    with locked(path, timeout=0) as held:
        yield held
