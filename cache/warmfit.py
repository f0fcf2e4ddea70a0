"""Which of this node's shards a warm copies: the job's own staging cap, then the cache budget.

Kept apart from the copying in `warmer` because these are the decisions that can refuse a warm
(``BudgetError``) or leave shards to fetch on demand; each says why in one warning line.
"""

from __future__ import annotations

from collections.abc import Callable

from ..format.manifest import Manifest
from .budget import Budget, evict
from .cachedir import VersionDir
from .errors import BudgetError
from .evict import choose_fit
from .report import WarmReport


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
    report: WarmReport,
    vd: VersionDir,
    m: Manifest,
    shards: list[int],
    todo: list[int],
    cache_dir: str,
    budget: Budget,
    best_effort: bool,
    log: Callable[[str], None],
    keep: frozenset[str] = frozenset(),
    live: frozenset[str] | None = None,
    size_in_cache: dict[int, int] | None = None,
) -> list[int]:
    """The shards of ``todo`` the warm copies under ``budget``, after evicting what they need
    (`Budget`); BudgetError where they do not fit, or with ``best_effort`` those that fit (the
    others recorded in ``report.not_fitted``, with a warning). ``size_in_cache``: shard -> bytes
    it takes in the cache (plain bytes where decompressed)."""
    if not budget.active:
        return todo
    size = size_in_cache or {i: m.shards[i].bytes for i in todo}
    incoming = sum(size[i] for i in todo)
    room = budget.measure(cache_dir, current=vd, assigned=set(shards), protected=set(shards), keep=keep, live=live)
    limit = room.limit
    shortfall = room.planned_shortfall(incoming)
    if shortfall:
        evictable = sum(e.size for e in room.entries if not e.protected)
        resident = room.used - evictable
        needed = resident + incoming
        msg = (
            f"this node's shards need {needed / 1e9:.3f} GB ({needed} bytes: {len(todo)} to copy, "
            f"{incoming} bytes) but the cache budget allows {max(limit, 0) / 1e9:.3f} GB ({limit} bytes; "
            f"{budget.flags()}); short by {shortfall} bytes"
        )
        if not best_effort:
            hint = (
                "; --best-effort (best_effort=True) warms what fits and leaves the rest to the loader's fetch on a miss"
            )
            raise BudgetError(msg + hint, needed=needed, available=max(limit, 0))
        freed, gone = evict(room.where, room.entries, evictable)
        report.evicted_shards, report.evicted_bytes = len(gone), freed
        return _best_effort(report, todo, size, max(limit - resident, 0), msg, log)
    freed, gone, short = room.make_room(incoming)
    report.evicted_shards, report.evicted_bytes = len(gone), freed
    if not short:
        return todo
    # make_room skips shards other processes are reading, so it may free less than planned.
    msg = (
        f"this node's shards need {incoming} more bytes ({len(todo)} shard(s) to copy) but the cache budget "
        f"allows {limit} bytes and {room.used - freed} bytes are cached and in use by readers; short by {short} "
        f"bytes ({budget.flags()})"
    )
    if not best_effort:
        raise BudgetError(msg, needed=room.used - freed + incoming, available=limit)
    return _best_effort(report, todo, size, max(limit - (room.used - freed), 0), msg, log)


def _best_effort(
    report: WarmReport, todo: list[int], size: dict[int, int], room: int, msg: str, log: Callable[[str], None]
) -> list[int]:
    """The shards of ``todo`` that fit in ``room`` bytes, in order; the rest recorded as not fitted."""
    take, leave = choose_fit([(i, size[i]) for i in todo], room)
    report.not_fitted = sorted(set(report.not_fitted) | set(leave))
    report.warnings.append(msg + f"; best effort: warming {len(take)} shard(s), {len(leave)} did not fit")
    log(report.warnings[-1])
    return take
