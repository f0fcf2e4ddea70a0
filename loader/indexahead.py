"""A remote dataset's sample indexes, and the schema its record batches are decoded with, read
before a pass's workers fork: all at once, and from the loader's construction on in the background.

A worker would otherwise fetch each index the first time a batch touches its shard, one request's
wait after another, and every worker again; fetched in the rank's process before the fork, the
workers inherit them. The rank's own shards are known from its range alone (ranges are sticky,
docs/architecture.md §2.3), before the pass's plan: their fetch starts when the loader is made,
so it overlaps what the trainer does before its first batch (and that first ``next()``'s own
plan, whose lengths are another read), where it waited for the plan before. Each index is a
future of its own: the fetch of the pass's first record batches (`loader.remotefetch.hand_down`)
starts for a shard as soon as its index is in, while the others are still on their way. The
lengths of the rank's range, which its plan reads, are likewise read from the construction on
(`in_background`, `shardtool.plan.Planner.expect_lengths`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..format.storage import S3_POOL_CONNECTIONS

__all__ = ["IndexesAhead", "fetch_indexes", "in_background"]


def in_background(fn: Callable[..., Any], *args: Any) -> Future:
    """``fn(*args)`` on a daemon thread of its own (a loader closed before its first pass does
    not wait for it), as a future: its error is raised by ``result()``."""
    done: Future = Future()

    def run() -> None:
        try:
            done.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits for the result
            done.set_exception(e)

    threading.Thread(target=run, name="shardtool-ahead", daemon=True).start()
    return done


def fetch_indexes(ds: Any, shards: list[int], tar: bool) -> None:
    """The sample indexes of ``shards`` of the remote dataset ``ds`` (kept by it), and the schema
    of its record batches (Arrow), fetched at once; errors raised, naming the shard."""
    if not shards:
        return
    with ThreadPoolExecutor(_threads(shards), thread_name_prefix="shardtool-index") as pool:
        schema = pool.submit(ds.batch_schema, shards[0]) if not tar else None
        list(pool.map(ds.shard_index, shards))
        if schema is not None:
            schema.result()


def _threads(shards: list[int]) -> int:
    # As many at once as the store's pooled connections (the fetch pool's 16 took three rounds
    # of requests for 34 indexes).
    return min(S3_POOL_CONNECTIONS, len(shards) + 1)


class IndexesAhead:
    """One rank's early fetch (`start`) and the fetch before its workers fork (`fetch`), which
    waits for the early one first: no index is asked for twice, and no thread of it outlives the
    fork."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._early: dict[int, Future] = {}

    def start(self, ds: Any, shards: list[int], tar: bool) -> None:
        """Fetch ``shards``' indexes in the background from now. A failure is left for `fetch`
        (or `index`), which asks again and raises it where the pass starts."""
        if not shards or self._pool is not None:
            return
        self._pool = pool = ThreadPoolExecutor(_threads(shards), thread_name_prefix="shardtool-index-early")
        if not tar:
            pool.submit(ds.batch_schema, shards[0])
        self._early = {s: pool.submit(ds.shard_index, s) for s in shards}

    def index(self, ds: Any, shard: int) -> Any:
        """``shard``'s index: the early fetch's, waited for, where it fetches it."""
        early = self._early.get(shard)
        if early is not None:
            try:
                return early.result()
            except Exception:  # noqa: BLE001 - asked again below, which raises it naming the shard
                pass
        return ds.shard_index(shard)

    def fetch(self, ds: Any, shards: list[int], tar: bool) -> None:
        """``shards``' indexes now, in the rank's process before its workers fork: the early fetch
        awaited, then those it did not bring (none, unless it failed or the pass reads others)."""
        self.settle()
        fetch_indexes(ds, shards, tar)

    def settle(self) -> None:
        """Wait for the early fetch, if one runs, and end its threads (before a fork). A loader
        closed before its first pass does not wait: the threads end with their requests."""
        pool, self._pool, self._early = self._pool, None, {}
        if pool is not None:
            pool.shutdown(wait=True)
