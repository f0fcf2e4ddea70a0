"""One function over many items in forked processes that inherit its inputs instead of receiving
them pickled: a report's plans of many data groups or ranks, whose inputs (a dataset with open
files and locks, a planner and its kept plans) cannot or should not be pickled."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

__all__ = ["forked_map"]

Item = TypeVar("Item")
Out = TypeVar("Out")

# The function and its inputs while a pool runs: set before the pool forks, so its processes
# inherit them. One pool at a time: a caller's pool is closed before `forked_map` returns.
_WORK: tuple[Callable[[Any, Any], Any], Any] | None = None


def forked_map(
    fn: Callable[[Any, Item], Out], work: Any, items: Sequence[Item], processes: int, chunksize: int = 1
) -> list[Out]:
    """``[fn(work, item) for item in items]``, over ``processes`` forked processes where there
    are several processes and items (in this process otherwise), in the items' order."""
    global _WORK
    if processes <= 1 or len(items) <= 1:
        return [fn(work, item) for item in items]
    if _WORK is not None:
        raise RuntimeError("shardtool internal error: forked_map called from inside a forked_map")
    import multiprocessing as mp

    _WORK = (fn, work)
    try:
        with mp.get_context("fork").Pool(processes) as pool:
            return pool.map(_call, items, chunksize=max(1, chunksize))
    finally:
        _WORK = None


def _call(item: Any) -> Any:
    if _WORK is None:
        raise RuntimeError("shardtool internal error: forked_map sets its work before it forks")
    fn, work = _WORK
    return fn(work, item)
