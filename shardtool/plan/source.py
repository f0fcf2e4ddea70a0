"""What the planner reads: per-shard summaries (O(shards)) and the lengths of one sample range.

A `PlanSource` is anything with ``summaries`` (a `ShardSummaries`) and ``lengths_range(lo, hi)``:
`shardtool.format.Dataset` and the node cache's dataset are (reading a memory map, one ranged
request, or the range's sample indexes); `ArraySource` wraps in-memory arrays for tests and
small tools; `shardtool.plan.synthetic.SyntheticSource` makes lengths up shard by shard. The
planner calls ``lengths_range`` only for the ranges it plans — its own group's — which is what
keeps a rank's cost proportional to its share of the data.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ..format.sketch import sketch_cells
from ..format.summaries import ShardSummaries

__all__ = ["ArraySource", "PlanSource", "as_lengths", "as_shard_counts"]


class PlanSource(Protocol):
    # Read-only: the planner only reads it, and `shardtool.format.Dataset` and the node cache's
    # dataset have it as a property (a protocol's plain attribute would have to be settable).
    @property
    def summaries(self) -> ShardSummaries: ...

    def lengths_range(self, lo: int, hi: int) -> np.ndarray: ...


def as_lengths(lengths) -> np.ndarray:
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"lengths must be 1-D, found shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"lengths must be integers, found dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and arr.min() < 0:
        bad = int(np.argmin(arr))
        raise ValueError(f"lengths must be >= 0, found {arr[bad]} at sample {bad}")
    return arr


def as_shard_counts(shard_counts, num_samples: int) -> np.ndarray:
    counts = np.asarray(shard_counts)
    if counts.ndim != 1 or (counts.size and not np.issubdtype(counts.dtype, np.integer)):
        raise ValueError(f"shard_counts must be a 1-D integer array, found {counts.dtype} {counts.shape}")
    counts = counts.astype(np.int64, copy=False)
    if counts.size and counts.min() < 0:
        raise ValueError(f"shard_counts must be >= 0, found {counts.min()}")
    if int(counts.sum()) != num_samples:
        raise ValueError(
            f"shard_counts must add up to the number of lengths: found {int(counts.sum())}, expected {num_samples}"
        )
    return counts


class ArraySource:
    """A plan source over in-memory lengths (tests, small tools); records the ranges it served.
    Its summaries are those `shardtool pack` stores (with the sketch; ``sketch=False``: as a
    dataset packed before it)."""

    def __init__(self, lengths, shard_counts, *, sketch: bool = True):
        self.lengths = as_lengths(lengths)
        self.shard_counts = as_shard_counts(shard_counts, self.lengths.size)
        cells = sketch_cells(self.shard_counts.size) if sketch else None
        self.summaries = ShardSummaries.from_lengths(self.lengths, self.shard_counts, cells)
        self.ranges_read: list[tuple[int, int]] = []

    def lengths_range(self, lo: int, hi: int) -> np.ndarray:
        self.ranges_read.append((lo, hi))
        return self.lengths[lo:hi]
