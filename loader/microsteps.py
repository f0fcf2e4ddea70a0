"""The steps of a token-budget ramp: each a list of the planned batches it takes, one micro-batch each.

Under ``max_tokens={0: 16384, 2000: 65536}`` the plan's batches are of the smallest budget and
step ``t`` takes ``max_tokens(t) / smallest`` of them (`shardtool.plan.schedule`). Bucketed
batches pad to their longest sample, so joining batches of other lengths into one tensor would
pad them all to the longest and overrun the step's budget; served as a list, each keeps its own
padding and the step holds at most its budget. Everything else (reading ahead, the metrics, the
workers) sees the step as the planned batches it takes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..plan.cost import segment_sums
from .workers import PlanBatches

__all__ = ["MicroSteps"]


class MicroSteps:
    """Step j: the list of ``batches``' batches ``bounds[j] .. bounds[j + 1] - 1``."""

    def __init__(self, batches: PlanBatches, bounds: np.ndarray):
        self.batches = batches
        self.bounds = np.asarray(bounds, dtype=np.int64)
        costs = batches.costs
        # Under a cost model, a step's cost is its micro-batches' (each padded on its own).
        self.costs = None if costs is None else self._per_step(np.asarray(costs))

    def __len__(self) -> int:
        return int(self.bounds.size - 1)

    def _range(self, j: int) -> range:
        return range(int(self.bounds[j]), int(self.bounds[j + 1]))

    def _per_step(self, values: np.ndarray) -> np.ndarray:
        """Per step: the sum of ``values`` (one per planned batch) over the batches it takes."""
        return segment_sums(np.asarray(values)[: int(self.bounds[-1])], self.bounds)

    def start_meter(self, meter: Any, workers: int, restart: bool, entered: float | None) -> None:
        meter.start_pass(*self.stats(), workers, restart, entered)

    def stats(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per step: samples, real tokens and padded tokens, each micro-batch padded on its own."""
        samples, tokens, padded = self.batches.stats()
        return self._per_step(samples), self._per_step(tokens), self._per_step(padded)

    def load(self, j: int, alloc: Any = None) -> list[Any]:
        return [self.batches.load(b, alloc) for b in self._range(j)]

    def inflate(self, start: int) -> None:
        self.batches.inflate(int(self.bounds[start]))

    def ahead_depth(self, prefetch: int) -> int:
        return self.batches.ahead_depth(prefetch)

    def reads(self, j: int) -> list[tuple[Any, np.ndarray]]:
        return [read for b in self._range(j) for read in self.batches.reads(b)]

    def batch_ids(self, j: int) -> np.ndarray:
        return self.batches.ids[
            int(self.batches.offsets[self.bounds[j]]) : int(self.batches.offsets[self.bounds[j + 1]])
        ]

    def describe(self, j: int) -> str:
        return "; ".join(self.batches.describe(b) for b in self._range(j))

    @property
    def pad(self) -> None:
        return None  # exact plans take no schedule (refused by the loader's options)
