"""Counters every reading process writes, in one shared table the trainer reads at any time.

The trainer creates a `Table` before its workers fork: one row per process (row 0 the trainer
itself when ``num_workers=0``, row ``w + 1`` worker ``w``), float64 columns in an anonymous
shared mapping, so a worker's counters cost a few stores and nothing crosses a pipe. Besides
counters, each row says what its process is reading right now (batch, shard, byte offset, tier,
since when): the watchdog reads that even while the worker is stuck inside a system call.

Shard-open latencies go to a log-spaced histogram (four buckets per octave from 1 µs), so
p50/p99 over any window are a difference of two snapshots. Values are plain stores into
aligned float64 cells: a reader may see one batch's counters half applied, never a torn number.
"""

from __future__ import annotations

import contextlib
import functools
import math
import mmap
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

# Tiers a shard's bytes come from.
TIERS = ("cache", "local", "remote")
CACHE, LOCAL, REMOTE = 1, 2, 3
# What a process is doing with its current shard.
PHASES = {0: "idle", 1: "opening", 2: "fetching (fetch-on-miss)", 3: "reading"}
IDLE, OPENING, FETCHING, READING = 0, 1, 2, 3

# Counter columns (summed over rows).
BATCHES, PRODUCE_S, BYTES_CACHE, BYTES_LOCAL, BYTES_REMOTE, HITS, MISSES, FETCH_BYTES, OPENS = range(9)
BYTES_OF_TIER = {CACHE: BYTES_CACHE, LOCAL: BYTES_LOCAL, REMOTE: BYTES_REMOTE}
# Activity columns (per row, not summed).
PID, BUSY_BATCH, BUSY_SHARD, BUSY_OFFSET, BUSY_SIZE, BUSY_TIER, BUSY_PHASE, BUSY_SINCE = range(9, 17)
HIST0 = 17
HIST_BUCKETS = 128
HIST_PER_OCTAVE = 4
HIST_FLOOR_S = 1e-6
FLUSH_BATCHES = 4  # a worker adds up its queued batch bytes at least this often (see Probe.flush)
COLUMNS = HIST0 + HIST_BUCKETS
COUNTERS = slice(0, OPENS + 1)
HIST = slice(HIST0, COLUMNS)


class Table:
    """rows x COLUMNS float64 in memory shared with every process forked after it."""

    def __init__(self, rows: int):
        self.rows = rows
        self._mm = mmap.mmap(-1, rows * COLUMNS * 8)  # anonymous + MAP_SHARED: forked children write here
        self.a = np.ndarray((rows, COLUMNS), dtype=np.float64, buffer=self._mm)
        self.a[:, BUSY_BATCH] = -1
        # The writers' view: a memoryview item store costs half a numpy scalar store.
        self.cells = memoryview(self._mm).cast("d")

    def totals(self) -> np.ndarray:
        """Counters and histogram summed over rows (a copy: a snapshot)."""
        return self.a.sum(axis=0)

    def activity(self, row: int, batch: int | None = None, waited: float = 0.0) -> dict | None:
        """What process ``row`` is reading now, or None if it is not inside a batch. The trainer
        (row 0) does not mark its batches (it is inside ``next()``): the caller says which one
        and for how long it has waited."""
        r = self.a[row]
        if batch is None and r[BUSY_BATCH] < 0:
            return None
        tier, phase = int(r[BUSY_TIER]), int(r[BUSY_PHASE])
        return {
            "pid": int(r[PID]) or os.getpid(),
            "batch": int(r[BUSY_BATCH]) if batch is None else batch,
            "shard": int(r[BUSY_SHARD]),
            "offset": int(r[BUSY_OFFSET]),
            "size": int(r[BUSY_SIZE]),
            "tier": TIERS[tier - 1] if tier else None,
            "phase": PHASES.get(phase, "?"),
            "for_s": time.monotonic() - r[BUSY_SINCE] if phase != IDLE or batch is None else waited,
        }

    def announce(self, row: int) -> None:
        """In the process of ``row``: its pid, so the watchdog can ask it for its stacks."""
        self.a[row, PID] = os.getpid()

    def pids(self) -> list[tuple[int, int]]:
        """(row, pid) of every worker row whose process announced itself."""
        return [(i, int(p)) for i, p in enumerate(self.a[1:, PID].tolist(), start=1) if p > 0]

    def forget_workers(self) -> None:
        """The pool is gone: its pids may be reused by unrelated processes, never signal them."""
        self.a[1:, PID] = 0
        self.a[1:, BUSY_BATCH] = -1


def bucket(seconds: float) -> int:
    if seconds <= HIST_FLOOR_S:
        return 0
    return min(int(HIST_PER_OCTAVE * math.log2(seconds / HIST_FLOOR_S)), HIST_BUCKETS - 1)


def percentiles(hist: np.ndarray, qs: tuple[float, ...]) -> list[float | None]:
    """Quantiles ``qs`` (0..1) of a latency histogram: the geometric middle of their buckets."""
    cum = np.cumsum(hist)
    total = float(cum[-1]) if len(cum) else 0.0
    if total <= 0:
        return [None for _ in qs]
    ks = np.searchsorted(cum, [q * total - 1e-9 for q in qs]).tolist()
    return [HIST_FLOOR_S * 2.0 ** ((k + 0.5) / HIST_PER_OCTAVE) for k in ks]


class Probe:
    """The recording side for one process: bound to its row of the table.

    Called per batch in the hot path, so each method is a handful of memoryview stores.
    """

    def __init__(self, table: Table, workers: int = 0):
        self.table = table
        self.cells = table.cells
        self.base = 0
        self.stride = max(workers, 1)  # a worker's batches of a pass are this far apart
        # Batches read by the token gather whose bytes are not added up yet (see `flush`).
        self.counts: list = []
        self.counts_other = 0
        self.counts_item = self.counts_tier = 0

    def bind(self, row: int) -> None:
        """In a worker, before its first batch: write to row ``row`` from now on. The trainer
        itself (num_workers=0) marks no batches: it is inside ``next()``, which it times."""
        self.base = row * COLUMNS
        self.table.announce(row)

    def timed(self, load: Callable, n: int) -> Callable:
        """A worker's ``load(b, alloc)`` of a pass of ``n`` batches, each marked and timed in its
        row (the trainer times its own batches: with num_workers=0 they are produced inside its
        next())."""
        return functools.partial(_timed_load, load, self, n)

    def batch_begin(self, b: int) -> float:
        """Batch ``b`` starts. Reads from memory maps are not announced one by one (that costs
        more than the rest of the metrics together): the watchdog finds where ``b`` starts."""
        c, i = self.cells, self.base
        now = time.monotonic()
        c[i + BUSY_BATCH] = b
        c[i + BUSY_SINCE] = now
        return now

    def batch_end(self, began: float, last: bool) -> None:
        """``last``: this process's last batch of the pass, so nothing stays uncounted."""
        c, i = self.cells, self.base
        c[i + PRODUCE_S] += time.monotonic() - began
        c[i + BATCHES] += 1
        c[i + BUSY_BATCH] = -1
        if last or len(self.counts) >= FLUSH_BATCHES:
            self.flush()

    def batch_failed(self) -> None:
        """The batch raised: nothing is being read any more (the phase may be left mid-read)."""
        c, i = self.cells, self.base
        c[i + BUSY_BATCH] = -1
        c[i + BUSY_PHASE] = IDLE
        self.flush()

    def flush(self) -> None:
        """Add up the bytes of the batches the reader queued in ``counts`` (their element counts;
        ``counts_other``: their bytes besides elements of ``counts_item`` bytes). The reader only
        appends, a C call: a Python call per batch cost, in place, more than all other metrics."""
        if self.counts:
            total = int(np.concatenate(self.counts).sum()) * self.counts_item + self.counts_other
            self.counts, self.counts_other = [], 0
            self.read(self.counts_tier, total)

    def count_views(self, tier: int, groups: list) -> None:
        """Payload bytes of a batch's samples (every field), from the views of ``groups``
        ((view, rows, index in shard) per shard); remote views count what they fetch instead."""
        if groups and tier != REMOTE:
            parts = [v.sample_bytes[li] for v, _, li in groups]
            self.read(tier, int((parts[0] if len(parts) == 1 else np.concatenate(parts)).sum()))

    def queue_tokens(self, count: np.ndarray, other: int, item: int, tier: int) -> None:
        """A batch's token bytes, queued (``count``: its elements, of ``item`` bytes; ``other``:
        its bytes besides them) and added up by `flush`: no Python arithmetic per batch."""
        if tier == REMOTE:
            return  # remote views count what they fetch
        if self.counts and (self.counts_item != item or self.counts_tier != tier):
            self.flush()  # a mixture's readers share the probe: sources of other dtypes or tiers
        self.counts.append(count)
        self.counts_other += other
        self.counts_item, self.counts_tier = item, tier
        if len(self.counts) >= 64:  # num_workers=0 flushes at metrics() and pass end
            self.flush()

    def requests(self, shard: int, lock: threading.Lock):
        """``watch(start, size)`` for `Dataset.verified_ranges`: each request of ``shard``
        announced while it runs (the stall watchdog names it) and counted as remote bytes (under
        ``lock``: several threads fetch at once)."""

        @contextlib.contextmanager
        def watch(start: int, size: int):
            with lock:
                self.at(shard, start, size, REMOTE)
            yield
            with lock:
                self.read(REMOTE, size)
                self.done_reading()

        return watch

    def done_reading(self) -> None:
        """An announced open, fetch or ranged read returned: back to unannounced work."""
        self.cells[self.base + BUSY_PHASE] = IDLE

    def at(self, shard: int, offset: int, size: int, tier: int, phase: int = READING) -> None:
        """Announce the read about to start (what the watchdog reports if it never returns)."""
        c, i = self.cells, self.base
        c[i + BUSY_SHARD] = shard
        c[i + BUSY_OFFSET] = offset
        c[i + BUSY_SIZE] = size
        c[i + BUSY_TIER] = tier
        c[i + BUSY_PHASE] = phase
        c[i + BUSY_SINCE] = time.monotonic()

    def read(self, tier: int, nbytes: int) -> None:
        self.cells[self.base + BYTES_OF_TIER[tier]] += nbytes

    def opening(self, shard: int, src) -> tuple[float, int]:
        """Before opening ``shard`` of `Source` ``src``; returns the token for `opened`."""
        if src.is_cached(shard) is False:
            self.at(shard, 0, 0, REMOTE, FETCHING)
        else:
            self.at(shard, 0, 0, src.tier, OPENING)
        return time.monotonic(), shard

    def opened(self, token: Any, src) -> None:
        """``shard`` became readable: one open, its latency, and for a cache a hit or a miss
        (a miss is the first open of a shard this process copied from the source, on that open
        or ahead of it)."""
        began, shard = token
        c, i = self.cells, self.base
        c[i + BUSY_PHASE] = IDLE
        c[i + OPENS] += 1
        c[i + HIST0 + bucket(time.monotonic() - began)] += 1
        if src.tier == CACHE:
            fetched = src.take_fetched(shard)
            c[i + (MISSES if fetched else HITS)] += 1
            c[i + FETCH_BYTES] += fetched
            c[i + BYTES_REMOTE] += fetched


def _timed_load(load: Callable, probe: Probe, n: int, b: int, alloc: Any = None) -> Any:
    began = probe.batch_begin(b)
    try:
        out = load(b, alloc)
    except BaseException:
        probe.batch_failed()
        raise
    probe.batch_end(began, last=b + probe.stride >= n)
    return out


class NoProbe:
    """A reader's probe with metrics off: counts nothing, announces nothing, costs a call."""

    def timed(self, load: Callable, n: int) -> Callable:
        return load

    def opening(self, shard: int, src) -> None:
        return None

    def opened(self, token: Any, src) -> None:
        pass

    def count_views(self, tier: int, groups: list) -> None:
        pass

    def queue_tokens(self, count: np.ndarray, other: int, item: int, tier: int) -> None:
        pass

    def requests(self, shard: int, lock: threading.Lock) -> None:
        return None  # `Dataset.verified_ranges` reads unwatched


NO_PROBE = NoProbe()
