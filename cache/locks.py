"""Per-shard ``flock`` locks: exclusive to fetch or evict a shard, shared to read it.

``flock`` locks belong to an open file description, so the kernel releases them when the holder
dies (even by SIGKILL): a stale lock file is just a file, never a stuck lock. Two threads of one
process using separate descriptors exclude each other too, which is what the warmer's threads need.

A process forked while one of its threads holds a lock (a loader's workers, forked while the
trainer's fetch-ahead thread fetches a shard) inherits the descriptor, and with it the open file
description: closing the holder's descriptor would leave the lock held by the child until it
exits, and every other rank of the node would wait on that shard for the child's whole pass. So a
lock is let go with ``LOCK_UN`` before the close (`_release`), which frees it for every copy.

A reader may not be allowed to write the cache (root warmed it, the job's user reads it): on
Linux ``flock`` works on a descriptor opened read-only, so a shared lock needs read access only.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from collections.abc import Callable, Iterator

from .perms import DEFAULT_PERMS, Perms

# The lock file cannot be opened for writing: this process may only read the cache.
WRITE_DENIED = {errno.EACCES, errno.EPERM, errno.EROFS}

HELD, DONE, TIMED_OUT = "held", "done", "timed out"


def _open(path: str, perms: Perms) -> int:
    try:
        return os.open(path, os.O_RDWR)
    except FileNotFoundError:
        pass
    # Created here: only then does it get the cache's mode (an existing lock file keeps its own).
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
    try:
        try:
            fd = os.open(path, flags, perms.mode)
        except FileNotFoundError:
            perms.makedirs(os.path.dirname(path))
            fd = os.open(path, flags, perms.mode)
    except FileExistsError:  # a concurrent opener created it first
        return os.open(path, os.O_RDWR)
    try:
        perms.set_fd(fd)
    except OSError:
        os.close(fd)
        raise
    return fd


def _release(fd: int) -> None:
    """Unlock, then close: the unlock frees the lock for a forked child's copy of ``fd`` too (a
    close alone would not, see above). Unlocking a descriptor that holds nothing is harmless."""
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


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
def locked(
    path: str, *, shared: bool = False, timeout: float | None = None, perms: Perms = DEFAULT_PERMS
) -> Iterator[bool]:
    """Hold the lock on ``path`` for the block; yields False (not held) if ``timeout`` ran out."""
    fd = _open(path, perms)
    try:
        yield _acquire(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX, timeout) == HELD
    finally:
        _release(fd)


@contextlib.contextmanager
def exclusive_unless(
    path: str, done: Callable[[], bool] | None, *, timeout: float | None = None, perms: Perms = DEFAULT_PERMS
) -> Iterator[str]:
    """The exclusive lock for doing some work (fetching a shard), or DONE once ``done()`` is true.

    Never blocks in the kernel: whoever holds the lock may, once the work is done, keep it as a
    shared reader for as long as it reads (a loader with the shard open), so a waiter that only
    blocked would wait for that reader, not for the work. Yields HELD, DONE or TIMED_OUT."""
    fd = _open(path, perms)
    try:
        yield _acquire(fd, fcntl.LOCK_EX, timeout, done)
    finally:
        _release(fd)


@contextlib.contextmanager
def read_lock(path: str, *, perms: Perms = DEFAULT_PERMS) -> Iterator[bool]:
    """A shared lock for reading, on a cache this process may not be allowed to write. Yields
    False when no lock file can be opened at all (a read-only cache whose writer never locked
    this shard); reading is still safe then, as an evicted file lives on while it is open."""
    try:
        fd = _open(path, perms)
    except OSError as e:
        if e.errno not in WRITE_DENIED and not isinstance(e, FileNotFoundError):
            raise
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            yield False
            return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only for a fetch or an eviction in progress
        yield True
    finally:
        _release(fd)


@contextlib.contextmanager
def try_exclusive(path: str, *, perms: Perms = DEFAULT_PERMS) -> Iterator[bool]:
    """Exclusive lock without waiting: False means someone is fetching or reading the shard."""
    with locked(path, timeout=0, perms=perms) as held:
        yield held


def held_exclusively(path: str) -> bool:
    """Whether someone holds ``path``'s exclusive lock (fetching or evicting) right now: a
    non-blocking shared attempt, on a read-only descriptor where this process may not write."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False  # no lock file: nobody ever locked the shard
    try:
        return _acquire(fd, fcntl.LOCK_SH, 0) != HELD
    finally:
        _release(fd)
