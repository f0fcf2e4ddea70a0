"""Compressed Arrow shards rewritten plain into memory, and the board forked readers watch.

`write_shared` writes a shard's plain Arrow IPC file into memory mapped shared (an `Arena`, made
before the workers fork, so they see what the rank's process writes there after), its record batches
decompressed on the decompression pool's threads (`format.decompress`, the one decompression path)
and written in order by the calling thread: a shard takes the pool's cores, not one, so the shard a
pass needs first is ready soonest. The arena's board says per shard whether it is ready, still being written, or to be
read record batch by record batch instead (`loader.inflate`). `decompress` is the one-thread
form into private memory, for a shard larger than its manifest says.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Literal, overload

import numpy as np
import pyarrow as pa

from ..format.decompress import Decompressor

PENDING, ABSENT = -1, -2  # on the board: not written yet; not held (read it record batch by record batch)
SLACK = 64 << 10  # beyond the plain size the manifest records: the footer of a batch-heavy file


class ForkGate:
    """Forks wait for a fill to stand between two record batches. Arrow allocates as it decompresses
    (on the pool's threads too), and a worker forked while another thread is inside the allocator
    may inherit its lock held. The fill holds ``lock`` while Arrow works for it and lets go at a
    record batch's end when a fork is due; `os.register_at_fork` hooks take it around each fork."""

    WAIT_S = 10.0  # the most a fork waits (a record batch takes milliseconds); then it goes ahead

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.due = False
        _gates.add(self)

    def __enter__(self) -> ForkGate:
        self.lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.lock.release()

    def let_fork(self) -> None:
        """At a record batch's end, with nothing in flight: a fork that is due goes now."""
        if self.due:
            self.lock.release()
            while self.due:
                time.sleep(1e-4)
            self.lock.acquire()

    def _before(self) -> None:
        self.due = True
        self._held = self.lock.acquire(timeout=self.WAIT_S)

    def _after_parent(self) -> None:
        self.due = False
        if self._held:
            self.lock.release()

    def _after_child(self) -> None:
        self.lock, self.due = threading.Lock(), False  # the child runs no fill


_gates: weakref.WeakSet = weakref.WeakSet()


def _each(method: str):
    return lambda: [getattr(g, method)() for g in list(_gates)]


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_each("_before"), after_in_parent=_each("_after_parent"), after_in_child=_each("_after_child")
    )


class Stopped(Exception):
    """The fill was told to stop (the loader closed) part-way through a shard."""


class Arena:
    """A pass's shards being filled, in one memory file (a memfd) the workers inherit by fork: a
    board of one int64 a shard (`PENDING`, `ABSENT`, or the plain length of its file, ready),
    then each shard's reserved region. Nothing is allocated until written; any process maps a
    ready shard's exact length from the file (an Arrow file is read from its end). Only the
    rank's process writes. Ordering: the writer maps the shard's exact view (a syscall that takes
    the address-space lock) before it sets the flag, a reader maps it after reading the flag."""

    def __init__(self, sizes: dict[int, int]):
        g = mmap.ALLOCATIONGRANULARITY
        self.slot = {s: k for k, s in enumerate(sizes)}
        self.offset: dict[int, int] = {}
        self.size = dict(sizes)
        head = at = -(-8 * (len(sizes) + 3) // g) * g
        for s, n in sizes.items():
            self.offset[s] = at
            at += -(-max(n, 1) // g) * g
        self._fd: int | None = _memory_file(at)
        self._board: mmap.mmap | None = mmap.mmap(self._fd, head)
        # One aligned int64 load or store a flag: never a value half written (struct packs and
        # unpacks byte by byte, which nothing promises a reader in another process sees whole).
        # Three flags past the shards' count the ready flags a reader did not believe
        # (`Inflated.get`), in any process, and the last one's shard and value: to find the cause.
        self._flags: np.ndarray | None = np.frombuffer(self._board, dtype=np.int64, count=len(sizes) + 3)
        self._flags[: len(sizes)] = PENDING
        self._flags[len(sizes) :] = 0

    def get(self, shard: int) -> int:
        flags = self._flags
        return ABSENT if flags is None else int(flags[self.slot[shard]])

    def set(self, shard: int, value: int) -> None:
        flags = self._flags
        if flags is not None:
            flags[self.slot[shard]] = value

    @property
    def refused(self) -> tuple[int, int, int]:
        """(ready flags not believed, the last one's shard, its value)."""
        flags = self._flags
        return (0, -1, 0) if flags is None else (int(flags[-3]), int(flags[-2]), int(flags[-1]))

    def refuse(self, shard: int, value: int) -> None:
        """Counts a ready flag not believed (not atomic: any count above 0 says it happened)."""
        flags = self._flags
        if flags is not None:
            flags[-2:] = shard, value
            flags[-3] += 1

    def region(self, shard: int) -> mmap.mmap:
        """Shard ``shard``'s whole reserved region, to write."""
        return mmap.mmap(self._file(), self.size[shard], offset=self.offset[shard])

    def view(self, shard: int, n: int) -> mmap.mmap:
        """Its first ``n`` bytes (the file written there), mapped shared, in this process."""
        return mmap.mmap(self._file(), max(n, 1), offset=self.offset[shard])

    def _file(self) -> int:
        fd = self._fd
        # Open while anything maps a shard: the fill is joined before the arena closes, and a
        # reader of a closed arena's board finds every shard ABSENT (`get`), so maps none.
        if fd is None:
            raise RuntimeError("shardtool internal error: the arena is closed")
        return fd

    def close(self) -> None:
        """The board and the file go; views mapped keep their memory until they are closed."""
        self._flags = None  # its export of the board first: a map with exports cannot close
        b, self._board = self._board, None
        if b is not None:
            b.close()
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def _memory_file(size: int) -> int:
    """A descriptor of ``size`` bytes of memory, sparse (a memfd; elsewhere an unlinked temp file)."""
    try:
        fd = os.memfd_create("shardtool-inflate", getattr(os, "MFD_CLOEXEC", 0))
    except (AttributeError, OSError):
        import tempfile

        with tempfile.TemporaryFile() as f:
            fd = os.dup(f.fileno())
    try:
        os.ftruncate(fd, size)
    except OSError:
        os.close(fd)
        raise
    return fd


def free(mm: mmap.mmap) -> None:
    """Closes ``mm``, giving its memory back now where it is an `Arena` view or region (other
    shards of its arena keep the file alive): only where no process reads it any more."""
    try:
        mm.madvise(mmap.MADV_REMOVE)
    except (AttributeError, OSError, ValueError):
        pass  # a private copy: its pages go with its last map
    close_map(mm)


class _FillPause:
    """`write_shared`'s `Pause`: stop where the loader closes, and let a due fork go."""

    def __init__(self, name: str, stop: threading.Event | None, gate: ForkGate | None):
        self.name, self.stop, self.gate = name, stop, gate

    def wanted(self) -> bool:
        if self.stop is not None and self.stop.is_set():
            raise Stopped(self.name)
        return self.gate is not None and self.gate.due

    def quiet(self) -> None:
        if self.gate is not None:
            self.gate.let_fork()


def write_shared(
    mm: mmap.mmap,
    data,
    name: str,
    pool: ThreadPoolExecutor | None,
    stop: threading.Event | None = None,
    gate: ForkGate | None = None,
) -> int | None:
    """Bytes of the compressed shard ``data``'s (a verified map) plain Arrow IPC file written into
    ``mm`` (`Decompressor.write_plain`, on ``pool``'s threads); None where they do not fit ``mm``.
    `Stopped` where ``stop`` is set between two record batches; ``gate`` (held by the caller) lets
    a fork go between two, with none in flight. Returns only once no thread reads ``data`` and the
    writer is gone, so that ``mm`` has no exports left (resize and close need that)."""
    dec = Decompressor(data, f"shard {name}")
    sink = pa.FixedSizeBufferWriter(pa.py_buffer(mm))
    try:
        dec.write_plain(sink, pool, _FillPause(name, stop, gate))
        return sink.tell()
    except OSError:  # "Write out of bounds": larger than the manifest says
        if stop is not None and stop.is_set():
            raise Stopped(name) from None
        return None


def decompress(data, name: str, plain_bytes: int) -> mmap.mmap:
    """The plain Arrow IPC file of the compressed shard ``data`` (a verified map) in anonymous
    private memory: an mmap, so that it reads (slices to bytes, buffer addresses) exactly as a
    shard's map does. Written straight into memory of the size the manifest records for it, then
    cut to what was written; a shard larger than recorded (an older manifest) is written again,
    growing. `FormatError` naming the shard where its bytes cannot be decompressed."""
    if plain_bytes > 0:
        # Not populated ahead: zeroing the whole map first and then writing it moves every byte
        # through memory twice, where a page faulted in by the write is zeroed and filled while in
        # cache (3x the time, 200k corpus, 2026-12-07). Private: a fork shares the pages, copying none.
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        mm = mmap.mmap(-1, plain_bytes + SLACK, flags=flags)
        try:
            n = write_shared(mm, data, name, None)
        except BaseException:
            close_map(mm)
            raise
        if n is not None:
            return cut(mm, n)
        close_map(mm)
    stream = pa.BufferOutputStream()
    Decompressor(data, f"shard {name}").write_plain(stream)
    out = stream.getvalue()
    mm = mmap.mmap(-1, max(out.size, 1))
    mm[: out.size] = memoryview(out)
    return cut(mm, out.size)


@overload
def cut(mm: mmap.mmap, n: int, *, copy: Literal[True] = ...) -> mmap.mmap: ...
@overload
def cut(mm: mmap.mmap, n: int, *, copy: bool) -> mmap.mmap | None: ...


def cut(mm: mmap.mmap, n: int, *, copy: bool = True) -> mmap.mmap | None:
    """``mm`` cut to its first ``n`` bytes (an Arrow file is read from its end: its footer), in
    this process (a forked one's map of the same memory keeps its length). Where the platform
    cannot (no mremap): a copy, or None where ``copy`` is false."""
    if n == len(mm):
        return mm
    try:
        mm.resize(n)
        return mm
    except (OSError, SystemError, ValueError):
        if not copy:
            return None
        exact = mmap.mmap(-1, n)
        exact[:n] = mm[:n]
        mm.close()
        return exact


def close_map(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:
        pass  # a view handed out still points into it: freed when that view is collected
