"""Reading ahead in plan order: the remote record batches (no node cache), or the shards a node
cache lacks (`loader.cachefill`), of the batches a process loads next are fetched while it
loads this one.

The plan says which batches each process loads and in which order: a worker of ``W`` loads every
W-th batch, the trainer without workers every batch. Before loading batch ``b`` the loader starts
the fetches of batch ``b`` (every shard's at once, not shard after shard) and of the ``depth``
batches that process loads after it (``prefetch_factor``; a node cache's fills at least
`FILL_AHEAD`, as what they fetch lands on disk), so a store's latency is waited about once per
batch, while the trainer steps, not once per shard a batch touches. What is fetched ahead is held until read:
at most ``depth`` batches' record batches on top of the decompressed record batches a process
keeps (`loader.batchcache`); shards a node cache fetches ahead are held in it. Local shards, a
node cache with a byte budget and a remote tar without a cache are not read ahead: their loads
are not wrapped.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

import numpy as np

from ..format.errors import FormatError
from .reader import BatchReader
from .remotefetch import HAND_DOWN_BYTES

__all__ = ["ReadAhead", "hand_down_first", "read_ahead"]


class Reads(Protocol):
    """What a worker pool loads (`PlanBatches`, `MixtureBatches`), as read-ahead sees it."""

    def __len__(self) -> int: ...

    def reads(self, b: int) -> list[tuple[BatchReader, np.ndarray]]:
        """The samples batch ``b`` reads, with the reader that reads them."""

    def ahead_depth(self, prefetch: int) -> int:
        """How many of a process's next batches to fetch ahead: the most its readers take
        (`BatchReader.ahead_depth`); 0 where none fetches from a store."""


class ReadAhead:
    """``load(b, alloc)`` after starting the fetches of batch ``b`` and of the ``depth`` batches
    ``stride`` apart after it."""

    def __init__(self, load: Callable[..., Any], batches: Reads, stride: int, depth: int):
        self.load, self.batches, self.stride, self.depth = load, batches, stride, depth

    def __call__(self, b: int, alloc: Any = None) -> Any:
        self._start(b)
        out = self.load(b, alloc)
        # After the load: the batches ahead would otherwise compete with this one's requests (at a
        # pass's start, every worker's whole read-ahead at once). A failed load ends the pass.
        for nb in range(b + self.stride, min(len(self.batches), b + self.depth * self.stride + 1), self.stride):
            self._start(nb)
        return out

    def _start(self, b: int) -> None:
        try:
            for reader, ids in self.batches.reads(b):
                reader.fetch_ahead(ids)
        except (FormatError, OSError):
            pass  # the read of that batch raises it again, naming the batch


def read_ahead(load: Callable[..., Any], batches: Reads, *, stride: int, depth: int) -> Callable[..., Any]:
    """``load`` reading ahead (`ReadAhead`) where ``batches`` fetch from a store: ``depth``
    (prefetch_factor) batches ahead, or more where their readers fill a node cache
    (`Reads.ahead_depth`); else ``load`` as it is."""
    ahead = batches.ahead_depth(max(depth, 0))
    if ahead <= 0:
        return load
    return ReadAhead(load, batches, max(stride, 1), ahead)


def hand_down_first(batches: Reads, start: int, count: int, budget: int = HAND_DOWN_BYTES) -> None:
    """Before a pass forks its workers: fetch here the remote record batches of its batches
    ``start`` .. ``start + count - 1`` (the ones the workers are sent first), in batch order up to
    ``budget`` stored bytes, and wait for them; the workers inherit them
    (`loader.remotefetch.hand_down`). A batch's fetches start as soon as its shards' indexes are
    in, while the next batches' indexes are still on their way. One that fails is left to the
    worker's read, which names it."""
    jobs: list[Future] = []
    seen: set[tuple[int, int, int]] = set()
    total = 0
    try:
        for b in range(start, min(len(batches), start + count)):
            for reader, ids in batches.reads(b):
                new: dict[int, list[int]] = {}
                for shard, sample, size in reader.handable(ids):
                    if (id(reader), shard, sample) in seen:
                        continue
                    if total + size > budget:
                        raise _Full
                    seen.add((id(reader), shard, sample))
                    new.setdefault(shard, []).append(sample)
                    total += size
                jobs += [job for shard, samples in new.items() if (job := reader.hand_down(shard, samples)) is not None]
    except _Full:
        pass
    except (FormatError, OSError):
        pass  # the read of that batch raises it again, naming the batch
    for job in jobs:
        try:
            job.result()
        except (FormatError, OSError):
            pass


class _Full(Exception):
    """The hand-down's budget is spent."""
