"""One partition of a Ray Dataset or Spark DataFrame, packed as one task of a job array."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Partition"]


@dataclass(frozen=True)
class Partition:
    """Task ``index`` of ``count``: its rows are samples ``first .. first + rows - 1`` of ``total``
    (their keys), so the merged dataset numbers every row once, in partition order."""

    index: int
    count: int
    first: int
    total: int
