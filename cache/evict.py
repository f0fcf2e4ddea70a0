"""The eviction decision, as pure functions of what is cached (property-tested directly).

Order: shards of versions no running job on the node asked for (``idle``) first, then shards not
assigned to this node, then least recently used, ties by key so the result is deterministic. Never
a shard in use (being read or fetched) nor one the current warm wants (``protected``).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    key: Hashable  # (version dir, shard index)
    size: int
    assigned: bool  # assigned to this node by the current plan
    last_used: float
    in_use: bool = False
    protected: bool = False
    # No running job on the node asked for this shard's version (`shardtool.cache.jobs`): such
    # versions go first. False wherever nothing records jobs (a plain warm): the order is unchanged.
    idle: bool = False


def effective_limit(used: int, free: int, *, max_bytes: int | None, min_free: int | None) -> int | None:
    """Most bytes the cache may hold: under ``max_bytes`` and leaving ``min_free`` free on the disk."""
    limits = []
    if max_bytes is not None:
        limits.append(max_bytes)
    if min_free is not None:
        limits.append(used + free - min_free)
    return min(limits) if limits else None


def eviction_order(entries: Iterable[Entry]) -> list[Entry]:
    candidates = [e for e in entries if not e.in_use and not e.protected]
    return sorted(candidates, key=lambda e: (not e.idle, e.assigned, e.last_used, repr(e.key)))


def plan_eviction(entries: Sequence[Entry], *, used: int, limit: int | None, incoming: int) -> tuple[list[Entry], int]:
    """(victims, shortfall): the fewest shards, in eviction order, whose removal lets ``incoming``
    bytes fit under ``limit``; ``shortfall`` > 0 means even evicting every candidate is not enough
    (then no victims are returned: evicting would lose data and still not fit)."""
    if limit is None:
        return [], 0
    need = used + incoming - limit
    if need <= 0:
        return [], 0
    victims: list[Entry] = []
    freed = 0
    for e in eviction_order(entries):
        if freed >= need:
            break
        victims.append(e)
        freed += e.size
    if freed < need:
        return [], need - freed
    return victims, 0


def choose_fit(wanted: Sequence[tuple[int, int]], room: int) -> tuple[list[int], list[int]]:
    """Best effort: take wanted (shard, size) pairs in order while they fit in ``room`` bytes."""
    take, leave = [], []
    for shard, size in wanted:
        if size <= room:
            take.append(shard)
            room -= size
        else:
            leave.append(shard)
    return take, leave
