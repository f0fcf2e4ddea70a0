"""In-job staging, the decisions: in which order a node's ranks first touch its shards, and which
shards a node's stager fetches next given how far its slowest reader got. Pure (numpy only); the
I/O loop that acts on them is `shardtool.cache.stager`.

A *touch order* is two equal-length arrays: ``shards`` (each shard once) and ``steps`` (the batch
index at which it is first read), sorted by step, ties by shard id. Steps are batch indexes of the
epoch (a resumed pass starts at its first unserved batch): every rank of a DDP job is at the same
step, so the ranks' orders merge by step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TouchOrder:
    shards: np.ndarray  # int64, each shard once, in the order first read
    steps: np.ndarray  # int64, non-decreasing: the batch index of that first read

    def __len__(self) -> int:
        return int(self.shards.size)

    def to_dict(self, epoch: int) -> dict:
        return {"epoch": int(epoch), "shards": self.shards.tolist(), "steps": self.steps.tolist()}

    @classmethod
    def from_dict(cls, d: dict) -> TouchOrder:
        shards, steps = np.asarray(d["shards"], np.int64), np.asarray(d["steps"], np.int64)
        if shards.shape != steps.shape or shards.ndim != 1:
            raise ValueError(f"a touch order needs as many steps as shards, found {shards.shape} and {steps.shape}")
        return cls(shards, steps)


def _sorted(shards: np.ndarray, steps: np.ndarray) -> TouchOrder:
    """Each shard at its earliest step, ordered by (step, shard)."""
    if not shards.size:
        return TouchOrder(np.zeros(0, np.int64), np.zeros(0, np.int64))
    by = np.lexsort((steps, shards))  # by shard, then step: the first of each shard is its earliest
    shards, steps = shards[by], steps[by]
    first = np.concatenate([[True], shards[1:] != shards[:-1]])
    shards, steps = shards[first], steps[first]
    by = np.lexsort((shards, steps))
    return TouchOrder(shards[by].astype(np.int64), steps[by].astype(np.int64))


def touch_order(ids: np.ndarray, offsets: np.ndarray, shard_offsets: np.ndarray, start: int = 0) -> TouchOrder:
    """One rank's touch order from its plan: batch ``i`` is ``ids[offsets[i]:offsets[i+1]]`` (global
    sample ids); ``shard_offsets`` are the manifest's cumulative sample counts (shard ``s`` holds
    samples ``[shard_offsets[s], shard_offsets[s+1])``). Batches before ``start`` are served."""
    ids = np.asarray(ids, np.int64)
    offsets = np.asarray(offsets, np.int64)
    lo = int(offsets[min(start, offsets.size - 1)]) if offsets.size else 0
    ids = ids[lo:]
    batch = np.repeat(np.arange(offsets.size - 1, dtype=np.int64), np.diff(offsets))[lo:]
    shard = np.searchsorted(np.asarray(shard_offsets, np.int64), ids, side="right") - 1
    return _sorted(shard.astype(np.int64), batch)


def merge_orders(orders: Iterable[TouchOrder]) -> TouchOrder:
    """The node's touch order: each shard at the earliest step any of its ranks reads it."""
    orders = list(orders)
    if not orders:
        return _sorted(np.zeros(0, np.int64), np.zeros(0, np.int64))
    return _sorted(np.concatenate([o.shards for o in orders]), np.concatenate([o.steps for o in orders]))


def next_fetches(
    order: TouchOrder,
    sizes: Sequence[int] | np.ndarray,
    *,
    slowest_step: int,
    present: set[int],
    busy: set[int],
    ahead_shards: int,
    ahead_bytes: int | None = None,
    slots: int = 1,
) -> list[int]:
    """The shards to start fetching now, at most ``slots``, most urgent first.

    ``slowest_step`` is the batch the slowest reader needs next (its count of batches served).
    The *window* is every shard of ``order`` first read at or before it (due: a reader needs it
    now, and every shard of one batch at once) plus the next ``ahead_shards`` whose sizes add up to at most
    ``ahead_bytes`` (the first always counts, so a shard larger than the byte bound still comes).
    Shards already ``present`` or ``busy`` (being fetched by us) fill the window too: the bound is
    on what the cache holds ahead of the readers, not on what is in flight. Nothing outside the
    window is ever returned."""
    if slots <= 0:
        return []
    end = window_end(order, sizes, slowest_step=slowest_step, ahead_shards=ahead_shards, ahead_bytes=ahead_bytes)
    picks = []
    for s in order.shards[:end].tolist():
        if s in present or s in busy:
            continue
        picks.append(s)
        if len(picks) == slots:
            break
    return picks


def window_end(
    order: TouchOrder,
    sizes: Sequence[int] | np.ndarray,
    *,
    slowest_step: int,
    ahead_shards: int,
    ahead_bytes: int | None = None,
) -> int:
    """How many leading entries of ``order`` the window of `next_fetches` spans."""
    if ahead_shards < 1:
        raise ValueError(f"ahead_shards must be >= 1, found {ahead_shards}")
    k = int(np.searchsorted(order.steps, slowest_step, side="right"))  # the first shard not yet due
    end = min(k + ahead_shards, len(order))
    if ahead_bytes is not None and end > k:
        fits = np.cumsum(np.asarray(sizes, np.int64)[order.shards[k:end]]) <= ahead_bytes
        fits[0] = True
        end = k + int(np.count_nonzero(np.logical_and.accumulate(fits)))
    return end


__all__ = ["TouchOrder", "merge_orders", "next_fetches", "touch_order", "window_end"]
