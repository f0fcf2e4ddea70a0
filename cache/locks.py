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
from typing import Callable, Iterator

HELD, DONE, TIMED_OUT = "held", "done", "timed out"


def _open(path: str) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)


def _try(fd: int, mode: int) -> bool:
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        return False


def _acquire(fd: int, mode: int, timeout: float | None, done: Callable[[], bool] | None = None) -> str:
    """Take the lock; with ``done``, poll it instead of blocking and give up (DONE) as soon as
    ``done()`` says the work the lock guards was finished by its holder."""
    if timeout is None and done is None:
        fcntl.flock(fd, mode)
        return HELD
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = 0.005
    while True:
        if _try(fd, mode):
            return HELD
        if done is not None and done():
            return DONE
        if deadline is not None and time.monotonic() >= deadline:
            return TIMED_OUT
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


@contextlib.contextmanager
def locked(path: str, *, shared: bool = False, timeout: float | None = None) -> Iterator[bool]:
    """Hold the lock on ``path`` for the block; yields False (not held) if ``timeout`` ran out."""
    fd = _open(path)
    try:
        yield _acquire(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX, timeout) == HELD
    finally:
        os.close(fd)  # closing the descriptor releases the lock


@contextlib.contextmanager
def exclusive_unless(path: str, done: Callable[[], bool] | None, *, timeout: float | None = None) -> Iterator[str]:
    """The exclusive lock for doing some work (fetching a shard), or DONE once ``done()`` is true.

    Never blocks in the kernel: whoever holds the lock may, once the work is done, keep it as a
    shared reader for as long as it reads (a loader with the shard open), so a waiter that only
    blocked would wait for that reader, not for the work. Yields HELD, DONE or TIMED_OUT."""
    fd = _open(path)
    try:
        yield _acquire(fd, fcntl.LOCK_EX, timeout, done)
    finally:
        os.close(fd)


@contextlib.contextmanager
def try_exclusive(path: str) -> Iterator[bool]:
    """Exclusive lock without waiting: False means someone is fetching or reading the shard."""
    with locked(path, timeout=0) as held:
        yield held
