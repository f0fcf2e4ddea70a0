"""Byte ranges of one shard joined into fewer requests: neighbours within a gap are one read.

Against an object store a request costs its latency (tens of ms) and counts against the store's
request rate (S3 answers 503 SlowDown above a few thousand a second per prefix), while the bytes
between two samples cost little: at 100 MB/s, 64 KiB is ~0.6 ms. So the samples a batch reads
from one shard, sorted by offset, are read as runs: a run grows while the next range begins at
most ``gap`` bytes after the run's end and the run stays within ``max_bytes``. Tar members are
never back to back (a 512-byte header and padding lie between them), nor are Arrow record batches
(each has its message metadata before it), so a gap of 0 joins nothing of a real shard.

The bytes in a gap are read and dropped, so the gap is small by default: it joins neighbours (a
batch read in order, a packed `stream` row's documents, an Arrow shard's consecutive record
batches), not samples a shuffle scattered. ``SHARDTOOL_COALESCE_GAP`` sets it in bytes (default
64 KiB); a negative value reads every range by itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext

import numpy as np

__all__ = ["DEFAULT_GAP", "GAP_ENV", "MAX_RUN_BYTES", "Run", "coalesce", "gap_from_env", "read_coalesced"]

GAP_ENV = "SHARDTOOL_COALESCE_GAP"
DEFAULT_GAP = 64 << 10
MAX_RUN_BYTES = 32 << 20  # bounds the memory of one read; a single larger range is read alone

Run = tuple[int, int, np.ndarray]  # (first byte, end byte, indices into the ranges asked for)


def gap_from_env(env: Mapping[str, str] | None = None) -> int | None:
    """The gap ``SHARDTOOL_COALESCE_GAP`` says (bytes), or None where it turns coalescing off."""
    said = (os.environ if env is None else env).get(GAP_ENV, "").strip()
    if not said:
        return DEFAULT_GAP
    try:
        gap = int(said)
    except ValueError:
        raise ValueError(f"{GAP_ENV} must be an int (bytes; negative: off), found {said!r}") from None
    return None if gap < 0 else gap


def coalesce(offsets: np.ndarray, sizes: np.ndarray, gap: int | None, max_bytes: int = MAX_RUN_BYTES) -> list[Run]:
    """Runs covering the ranges ``[offsets[k], offsets[k] + sizes[k])``, in offset order; each
    range lies wholly in one run. ``gap`` None: one run per range (duplicates too)."""
    offsets = np.asarray(offsets, dtype=np.int64)
    sizes = np.asarray(sizes, dtype=np.int64)
    order = np.argsort(offsets, kind="stable")
    if gap is None:
        return [(int(offsets[k]), int(offsets[k] + sizes[k]), np.array([k])) for k in order.tolist()]
    runs: list[Run] = []
    start = end = -1
    members: list[int] = []
    for k in order.tolist():
        lo, hi = int(offsets[k]), int(offsets[k] + sizes[k])
        if members and lo - end <= gap and max(end, hi) - start <= max_bytes:
            end = max(end, hi)
            members.append(k)
            continue
        if members:
            runs.append((start, end, np.asarray(members, dtype=np.int64)))
        start, end, members = lo, hi, [k]
    if members:
        runs.append((start, end, np.asarray(members, dtype=np.int64)))
    return runs


def read_coalesced(
    read: Callable[[int, int], bytes],
    offsets: np.ndarray,
    sizes: np.ndarray,
    gap: int | None,
    watch: Callable[[int, int], AbstractContextManager] | None = None,
) -> list[memoryview]:
    """The bytes of every range, in the order asked, with one ``read(offset, size)`` per run;
    ``watch(offset, size)``, where given, is a context manager around each read (a probe that
    announces and counts it)."""
    out: list[memoryview] = [memoryview(b"")] * len(offsets)
    for start, end, members in coalesce(offsets, sizes, gap):
        with watch(start, end - start) if watch is not None else nullcontext():
            data = memoryview(read(start, end - start))
        for k in members.tolist():
            at = int(offsets[k]) - start
            out[k] = data[at : at + int(sizes[k])]
    return out
