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

import math
import mmap
import os
import time

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

    def activity(self, row: int) -> dict | None:
        """What process ``row`` is reading now, or None if it is not inside a batch."""
        r = self.a[row]
        if r[BUSY_BATCH] < 0:
            return None
        tier = int(r[BUSY_TIER])
        return {"pid": int(r[PID]), "batch": int(r[BUSY_BATCH]), "shard": int(r[BUSY_SHARD]),
                "offset": int(r[BUSY_OFFSET]), "size": int(r[BUSY_SIZE]),
                "tier": TIERS[tier - 1] if tier else None, "phase": PHASES.get(int(r[BUSY_PHASE]), "?"),
                "for_s": time.monotonic() - r[BUSY_SINCE]}

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


def percentile(hist: np.ndarray, q: float) -> float | None:
    """The ``q`` quantile (0..1) of a latency histogram: the geometric middle of its bucket."""
    total = float(hist.sum())
    if total <= 0:
        return None
    k = int(np.searchsorted(np.cumsum(hist), q * total - 1e-9))
    return HIST_FLOOR_S * 2.0 ** ((k + 0.5) / HIST_PER_OCTAVE)


class Probe:
    """The recording side for one process: bound to its row of the table.

    Called per batch in the hot path, so each method is a handful of memoryview stores.
    """

    def __init__(self, table: Table):
        self.table = table
        self.cells = table.cells
        self.base = 0

    def bind(self, row: int) -> None:
        """In a worker, before its first batch: write to row ``row`` from now on."""
        self.base = row * COLUMNS
        self.table.announce(row)

    def batch_begin(self, b: int) -> float:
        c, i = self.cells, self.base
        now = time.monotonic()
        c[i + BUSY_BATCH] = b
        c[i + BUSY_PHASE] = IDLE
        c[i + BUSY_SIZE] = 0
        c[i + BUSY_SINCE] = now
        return now

    def batch_end(self, began: float) -> None:
        c, i = self.cells, self.base
        c[i + PRODUCE_S] += time.monotonic() - began
        c[i + BATCHES] += 1
        c[i + BUSY_BATCH] = -1

    def at(self, shard: int, offset: int, size: int, tier: int, phase: int = READING) -> None:
        """Announce the read about to start (what the watchdog reports if it never returns)."""
        c, i = self.cells, self.base
        c[i + BUSY_SHARD] = shard
        c[i + BUSY_OFFSET] = offset
        c[i + BUSY_SIZE] = size
        c[i + BUSY_TIER] = tier
        c[i + BUSY_PHASE] = phase
        c[i + BUSY_SINCE] = time.monotonic()

    def mapped_read(self, shard: int, offset: int, tier: int) -> None:
        """A batch about to be read from memory maps, its first sample at ``offset`` of ``shard``
        (the batch's start time stands: four stores, every batch)."""
        c, i = self.cells, self.base
        c[i + BUSY_SHARD] = shard
        c[i + BUSY_OFFSET] = offset
        c[i + BUSY_TIER] = tier
        c[i + BUSY_PHASE] = READING

    def read(self, tier: int, nbytes: int) -> None:
        self.cells[self.base + BYTES_OF_TIER[tier]] += nbytes

    def opening(self, shard: int, src) -> tuple[float, int]:
        """Before opening ``shard`` of `Source` ``src``; returns the token for `opened`."""
        if src.is_cached(shard) is False:
            self.at(shard, 0, 0, REMOTE, FETCHING)
        else:
            self.at(shard, 0, 0, src.tier, OPENING)
        return time.monotonic(), src.fetched_bytes

    def opened(self, token: tuple[float, int], src) -> None:
        """``shard`` became readable: one open, its latency, and for a cache a hit or a miss
        (a miss is an open that copied the shard from the source)."""
        began, fetched_before = token
        c, i = self.cells, self.base
        c[i + OPENS] += 1
        c[i + HIST0 + bucket(time.monotonic() - began)] += 1
        if src.tier == CACHE:
            fetched = src.fetched_bytes - fetched_before
            c[i + (MISSES if fetched else HITS)] += 1
            c[i + FETCH_BYTES] += fetched
            c[i + BYTES_REMOTE] += fetched
