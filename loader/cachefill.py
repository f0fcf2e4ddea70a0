"""Fetch on a miss, ahead of the read: the shards a node cache lacks are fetched for the batch a
process loads, all at once, and for the batches it loads next (`loader.readahead`).

A node cache that was not warmed fetches a shard when a read first needs it. Read shard after
shard, a batch touching 8 missing shards waited for 8 fetches one after another, and under a
SlowDown limit every 503's backoff stopped the whole batch. Started together on the fetch pool,
they wait about once per batch, and one shard's backoff does not hold the others. A read of a
shard being fetched waits for it on the shard's lock (cache/locks.py), as a read of a shard
another process fetches does; a fetch that failed here is tried again by that read, which
raises its error naming the shard.

A cache with a byte budget is not filled ahead: a shard fetched for a later batch could evict one
this batch reads, or be evicted before its batch (`stage=True` plans the budget for that).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable

from .batchcache import fetch_pool

__all__ = ["FILL_AHEAD", "CacheFill"]

# Batches of a process whose missing shards are fetched ahead (`loader.readahead`), at least. Under a
# store's SlowDown a fetch can back off for a second or more; two batches ahead (prefetch_factor)
# did not cover that, and the pass waited on each backoff: an epoch of 362 shards behind a 50
# requests/s limit read them in 26-29 s after its first batch at 2, in 16 s at 16 (ideal 7 s).
# They land on disk, so memory does not bound this as it does remote record batches.
FILL_AHEAD = 16


class CacheFill:
    """The shards this process has started fetching into its node cache and not yet finished,
    and those it has seen there: each is checked once (a stat of its stamp), not every batch."""

    def __init__(self):
        self._pid = os.getpid()
        self._filling: set[int] = set()
        self._present: set[int] = set()  # one evicted since is fetched on its read's miss, as before
        self._lock = threading.Lock()

    @staticmethod
    def fills(cache) -> bool:
        """Whether reads through ``cache`` (a `DatasetCache`, or None) are filled ahead."""
        return cache is not None and not cache.budget.active

    def start(self, dataset, cache, shards: Iterable[int]) -> None:
        """Start fetching those of ``shards`` that ``cache`` lacks (``dataset``: the cached dataset
        whose `make_present` fetches one), and return."""
        if self._pid != os.getpid():  # a forked worker: the parent's fetches are not its own
            self._pid, self._filling, self._present, self._lock = os.getpid(), set(), set(), threading.Lock()
        pool = fetch_pool()
        for s in shards:
            with self._lock:
                if s in self._filling or s in self._present:
                    continue
                self._filling.add(s)
            if cache.is_cached(s):
                self._finished(s, present=True)
                continue
            pool.submit(self._fill, dataset, s)

    def _fill(self, dataset, shard: int) -> None:
        present = False
        try:
            dataset.make_present(shard)
            present = True
        except Exception:  # noqa: BLE001 - the read of that shard tries again and raises it, naming it
            pass
        finally:
            self._finished(shard, present)

    def _finished(self, shard: int, present: bool) -> None:
        with self._lock:
            self._filling.discard(shard)
            if present:
                self._present.add(shard)
