"""One data group's epoch: its range's samples → shuffled, bucketed batches → exactly k × n of
them → dealt to its k DP ranks. Costs O(the group's share): it reads only its range's lengths."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .balance import deal_order, fit_group
from .batching import bucket, gather_runs, group_rng
from .shape import PlanShape
from .source import PlanSource, as_lengths

__all__ = ["GroupPlan", "plan_group"]


@dataclass(frozen=True, eq=False)
class GroupPlan:
    """Local DP rank j's b-th batch is ``ids[offsets[j*n + b] : offsets[j*n + b + 1]]``."""

    group: int
    size: int  # DP ranks in the group
    batches_per_rank: int
    first: int  # the group's first global sample id
    lengths: np.ndarray  # lengths of the group's samples [first, first + len)
    ids: np.ndarray
    offsets: np.ndarray
    remainder: np.ndarray  # the group's samples no rank serves this epoch

    def batch(self, local_rank: int, index: int) -> np.ndarray:
        b = local_rank * self.batches_per_rank + index
        return self.ids[self.offsets[b] : self.offsets[b + 1]]

    def batch_lengths(self, ids: np.ndarray) -> np.ndarray:
        return self.lengths[ids - self.first]


def plan_group(source: PlanSource, shape: PlanShape, group: int, epoch: int) -> GroupPlan:
    """Group ``group``'s plan for ``epoch``: permuted by rng(seed, epoch, group) when shuffling,
    bucketed by length within windows, batch order shuffled, fitted to k × n batches, dealt."""
    if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
        raise ValueError(f"epoch must be an int >= 0, found {epoch!r}")
    batching = shape.batching
    lo, hi = int(shape.cuts[group]), int(shape.cuts[group + 1])
    lengths = as_lengths(source.lengths_range(lo, hi))
    if lengths.size != hi - lo:
        raise ValueError(f"the plan source gave {lengths.size} lengths for samples [{lo}, {hi})")
    if batching.max_tokens is not None and lengths.size and int(lengths.max()) > batching.max_tokens:
        bad = int(np.argmax(lengths))
        raise ValueError(f"sample {lo + bad} has length {int(lengths[bad])}, more than max_tokens="
                         f"{batching.max_tokens}; raise max_tokens or filter these samples out")
    k = shape.data_layout.group_sizes[group]
    n = shape.batches_per_rank
    ids = np.arange(lo, hi, dtype=np.int64)
    rng = group_rng(batching, int(epoch), group, shape.data_layout.num_groups) if batching.shuffle else None
    ordered, starts = bucket(ids, lengths, batching, shape.window, rng)
    if n == 0:
        return GroupPlan(group, k, 0, lo, lengths, np.zeros(0, np.int64), np.zeros(1, np.int64), ids)
    begin, end = fit_group(starts, k * n, int(epoch))
    order = deal_order(n, k)
    begin, end = begin[order], end[order]
    kept = gather_runs(ordered, begin, end - begin)
    offsets = np.concatenate([[0], np.cumsum(end - begin)]).astype(np.int64)
    served = np.zeros(hi - lo, dtype=bool)
    served[kept - lo] = True
    return GroupPlan(group, k, n, lo, lengths, kept, offsets, ids[~served])
