"""The plan source as a planner reads it: its last ``lengths_range`` answer kept, and one read
started ahead (by the loader) waited for, not asked again."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .source import PlanSource

__all__ = ["KeptLengths"]


class KeptLengths:
    """The plan source, keeping its last ``lengths_range`` answer: a one-group shape cut in order
    counts its batches from the same lengths the group's plan then reads (one read, not two; the
    plan keeps that array anyway)."""

    def __init__(self, source: PlanSource):
        self._inner = source
        self._last: tuple[int, int, Any] | None = None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_inner", "_last"):
            raise AttributeError(name)  # pickling looks these up before __init__ has run
        return getattr(self._inner, name)

    def expect(self, lo: int, hi: int, read: Callable[[int, int], Any]) -> None:
        """Samples [lo, hi)'s lengths will be ``read(lo, hi).result()`` (a read started now),
        unless they are kept already."""
        if self._last is None or self._last[:2] != (lo, hi):
            self._last = (lo, hi, read(lo, hi))

    def lengths_range(self, lo: int, hi: int) -> np.ndarray:
        if self._last is None or self._last[:2] != (lo, hi):
            self._last = (lo, hi, self._inner.lengths_range(lo, hi))
        got = self._last[2]
        if not isinstance(got, np.ndarray):  # a read started ahead
            try:
                got = got.result()
            except Exception:  # noqa: BLE001 - read again here, which raises it where the plan is made
                got = self._inner.lengths_range(lo, hi)
            self._last = (lo, hi, got)
        return got
