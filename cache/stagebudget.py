"""The cache budget as the stager applies it: the limit `warm` computes (`budget.Budget`:
``--max-bytes``, ``--min-free`` over the whole cache), checked before each fetch.

Apart from `stager` because it is the one place in-job staging can decline a shard. Unlike a warm,
the stager evicts nothing: it runs while ranks read, and a shard staged ahead of them is not
locked yet, so any eviction could drop a shard a rank is about to read. What does not fit is left
to the readers' fetch-on-miss. Scanning the cache stats every cached shard, so it is redone at most
once a second; in between, the stager adds what it copied itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from .budget import Budget


class StageBudget:
    """``sizes``: bytes each shard takes in the cache; ``budget``: the cache's (`DatasetCache.budget`).
    A budget with neither a byte limit nor a free-space floor fits every shard (no scan at all)."""

    def __init__(
        self,
        cache_dir: str,
        sizes: Sequence[int],
        budget: Budget,
        *,
        rescan_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.cache_dir, self.sizes = cache_dir, sizes
        self.budget = budget
        self.active = self.budget.active
        self.rescan_s, self.clock = rescan_s, clock
        self.used = 0  # shard bytes in the cache at the last scan, plus what this stager copied since
        self.limit: int | None = None
        self._next_scan = 0.0

    def _scan(self, force: bool = False) -> None:
        if force or self.clock() >= self._next_scan:
            room = self.budget.measure(self.cache_dir)
            self.used, self.limit = room.used, room.limit
            self._next_scan = self.clock() + self.rescan_s

    def copied(self, shard: int) -> None:
        self.used += self.sizes[shard]

    def fit(self, picks: Sequence[int], in_flight: Sequence[int]) -> tuple[list[int], list[int]]:
        """(take, over) of ``picks`` (most urgent first), with ``in_flight`` shards being fetched.
        Take in order while each fits; a shard that does not fit while others are in flight waits
        (they may be what fills the room); one that does not fit with nothing in flight, after a
        fresh scan, is over the budget. Picks after the first that waits are left for later."""
        if not self.active:
            return list(picks), []
        self._scan()
        pending = sum(self.sizes[i] for i in in_flight)
        take: list[int] = []
        over: list[int] = []
        for i in picks:
            if self._fits(i, pending):
                take.append(i)
                pending += self.sizes[i]
            elif pending:
                break
            else:
                self._scan(force=True)  # others may have evicted, or this stager's count be stale
                if self._fits(i, 0):
                    take.append(i)
                    pending += self.sizes[i]
                else:
                    over.append(i)
        return take, over

    def _fits(self, shard: int, pending: int) -> bool:
        return self.limit is None or self.used + pending + self.sizes[shard] <= self.limit

    def describe(self, shard: int, path: str) -> str:
        """One line: why ``shard`` is not staged."""
        limit = max(self.limit or 0, 0)
        return (
            f"cache budget reached: shard #{shard} {path} ({self.sizes[shard]} bytes) does not fit beside the "
            f"{self.used} bytes cached under the {limit} bytes the cache may hold ({self.budget.flags()}); "
            "it and any other shard over the budget are left to the readers' "
            "fetch-on-miss (the stager evicts nothing)"
        )


__all__ = ["StageBudget"]
