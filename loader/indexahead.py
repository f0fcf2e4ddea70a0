"""A remote dataset's sample indexes, and the schema its record batches are decoded with, read
before a pass's workers fork: all at once, and from the loader's construction on in the background.

A worker would otherwise fetch each index the first time a batch touches its shard, one request's
wait after another, and every worker again; fetched in the rank's process before the fork, the
workers inherit them. The rank's own shards are known from its range alone (ranges are sticky,
docs/architecture.md §2.3), before the pass's plan: their fetch starts when the loader is made,
so it overlaps what the trainer does before its first batch (and that first ``next()``'s own
plan, whose lengths are another read), where it waited for the plan before.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..format.storage import S3_POOL_CONNECTIONS

__all__ = ["IndexesAhead", "fetch_indexes"]


def fetch_indexes(ds: Any, shards: list[int], tar: bool) -> None:
    """The sample indexes of ``shards`` of the remote dataset ``ds`` (kept by it), and the schema
    of its record batches (Arrow), fetched at once; errors raised, naming the shard."""
    if not shards:
        return
    # As many at once as the store's pooled connections (the fetch pool's 16 took three rounds
    # of requests for 34 indexes); the threads end here.
    threads = min(S3_POOL_CONNECTIONS, len(shards) + 1)
    with ThreadPoolExecutor(threads, thread_name_prefix="shardtool-index") as pool:
        schema = pool.submit(ds.batch_schema, shards[0]) if not tar else None
        list(pool.map(ds.shard_index, shards))
        if schema is not None:
            schema.result()


class IndexesAhead:
    """One rank's early fetch (`start`) and the fetch before its workers fork (`fetch`), which
    waits for the early one first: no index is asked for twice, and no thread of it outlives the
    fork."""

    def __init__(self) -> None:
        self._early: threading.Thread | None = None

    def start(self, ds: Any, shards: list[int], tar: bool) -> None:
        """Fetch ``shards``' indexes in the background from now. A failure is left for `fetch`,
        which asks again and raises it where the pass starts."""
        if not shards or self._early is not None:
            return

        def quietly() -> None:
            try:
                fetch_indexes(ds, shards, tar)
            except Exception:  # noqa: BLE001 - asked again by `fetch`, which raises it naming the shard
                pass

        self._early = threading.Thread(target=quietly, name="shardtool-index-early", daemon=True)
        self._early.start()

    def fetch(self, ds: Any, shards: list[int], tar: bool) -> None:
        """``shards``' indexes now, in the rank's process before its workers fork: the early fetch
        awaited, then those it did not bring (none, unless it failed or the pass reads others)."""
        self.settle()
        fetch_indexes(ds, shards, tar)

    def settle(self) -> None:
        """Wait for the early fetch, if one runs (before a fork). A loader closed before its first
        pass does not wait: the daemon thread ends with its requests."""
        early, self._early = self._early, None
        if early is not None:
            early.join()
