"""Which of this node's shards a warm copies: the job's own staging cap, then the cache budget.

Kept apart from the copying in `warmer` because these are the decisions that can refuse a warm
(``BudgetError``) or leave shards to fetch on demand; each says why in one warning line.
"""

from __future__ import annotations

from .budget import disk_free, evict, scan
from .errors import BudgetError
from .evict import choose_fit, effective_limit, plan_eviction


def cap_to_stage(report, m, shards, todo, stage_bytes: int, log, size_in_cache) -> list[int]:
    """The job's cap: shards in range order, each staged if the node's share held stays under ``stage_bytes``."""
    held = report.bytes_skipped  # already trusted in the cache: they count, they cost nothing
    wanted = set(todo)
    take, leave = choose_fit([(i, size_in_cache[i]) for i in shards if i in wanted], max(stage_bytes - held, 0))
    if leave:
        report.not_fitted = sorted(leave)
        report.warnings.append(
            f"the job caps its staged shards at {stage_bytes} bytes on this node: {len(take)} "
            f"staged, {len(leave)} left to fetch on demand"
        )
        log(report.warnings[-1])
    return [i for i in todo if i in set(take)]


def fit_budget(
    report,
    vd,
    m,
    shards,
    todo,
    cache_dir,
    max_bytes,
    min_free,
    best_effort,
    log,
    keep=frozenset(),
    live=None,
    size_in_cache=None,
) -> list[int]:
    """``size_in_cache``: shard -> bytes it takes in the cache (plain bytes where decompressed)."""
    if max_bytes is None and min_free is None:
        return todo
    size = size_in_cache or {i: m.shards[i].bytes for i in todo}
    incoming = sum(size[i] for i in todo)
    entries, where, used = scan(
        cache_dir, current=vd, assigned=set(shards), protected=set(shards), keep=keep, live=live
    )
    limit = effective_limit(used, disk_free(cache_dir), max_bytes=max_bytes, min_free=min_free)
    assert limit is not None  # max_bytes or min_free is set (checked above)
    victims, shortfall = plan_eviction(entries, used=used, limit=limit, incoming=incoming)
    if shortfall:
        evictable = sum(e.size for e in entries if not e.protected)
        resident = used - evictable
        needed = resident + incoming
        room = max(limit - resident, 0)
        msg = (
            f"this node's shards need {needed / 1e9:.3f} GB ({needed} bytes: {len(todo)} to copy, "
            f"{incoming} bytes) but the cache budget allows {max(limit, 0) / 1e9:.3f} GB ({limit} bytes; "
            f"--max-bytes={max_bytes}, --min-free={min_free}); short by {shortfall} bytes"
        )
        if not best_effort:
            raise BudgetError(msg, needed=needed, available=max(limit, 0))
        freed, gone = evict(where, entries, evictable)
        report.evicted_shards, report.evicted_bytes = len(gone), freed
        take, leave = choose_fit([(i, size[i]) for i in todo], room)
        report.not_fitted = sorted(set(report.not_fitted) | set(leave))
        report.warnings.append(msg + f"; best effort: warming {len(take)} shard(s), {len(leave)} did not fit")
        log(report.warnings[-1])
        return take
    need = used + incoming - limit
    freed, gone = evict(where, entries, need)
    report.evicted_shards, report.evicted_bytes = len(gone), freed
    if freed >= need:
        return todo
    # evict() skips shards other processes are reading, so it may free less than planned.
    short = need - freed
    room = max(limit - (used - freed), 0)
    msg = (
        f"this node's shards need {incoming} more bytes ({len(todo)} shard(s) to copy) but the cache budget "
        f"allows {limit} bytes and {used - freed} bytes are cached and in use by readers; short by {short} bytes "
        f"(--max-bytes={max_bytes}, --min-free={min_free})"
    )
    if not best_effort:
        raise BudgetError(msg, needed=used - freed + incoming, available=limit)
    take, leave = choose_fit([(i, size[i]) for i in todo], room)
    report.not_fitted = sorted(set(report.not_fitted) | set(leave))
    report.warnings.append(msg + f"; best effort: warming {len(take)} shard(s), {len(leave)} did not fit")
    log(report.warnings[-1])
    return take
