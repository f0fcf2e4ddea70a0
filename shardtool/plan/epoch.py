"""One epoch's plan: the exact ordered batches of every rank."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .layout import Layout
from .balance import batches_per_rank, deal_order, fit_node
from .batching import Batching, gather_runs, bucket, node_rng, resolve_window
from .ranges import as_lengths, as_shard_counts, node_ranges

__all__ = ["EpochPlan", "plan_epoch", "plan_subset"]


@dataclass(frozen=True, eq=False)
class EpochPlan:
    """Every rank's batches for one epoch, stored flat.

    Rank r's i-th batch is sample_ids[batch_offsets[r*n + i] : batch_offsets[r*n + i + 1]]
    with n = batches_per_rank: one int64 array of ids and one of offsets,
    whatever the world size.
    """

    layout: Layout
    batching: Batching
    epoch: int
    batches_per_rank: int
    sample_ids: np.ndarray
    batch_offsets: np.ndarray
    remainder: np.ndarray
    padding_efficiency: float

    def _first(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.layout.world_size:
            raise ValueError(f"rank must be in [0, {self.layout.world_size}), found {rank!r}")
        return int(rank) * self.batches_per_rank

    def batch(self, rank: int, index: int) -> np.ndarray:
        """Global sample ids of rank's batch `index`, in order."""
        if not 0 <= index < self.batches_per_rank:
            raise ValueError(f"batch index must be in [0, {self.batches_per_rank}), found {index}")
        b = self._first(rank) + index
        return self.sample_ids[self.batch_offsets[b] : self.batch_offsets[b + 1]]

    def rank_batches(self, rank: int, start: int = 0) -> list[np.ndarray]:
        """Rank's batches from `start` on, each an array of global sample ids (views, not copies)."""
        first = self._first(rank)
        bounds = self.batch_offsets[first + start : first + self.batches_per_rank + 1].tolist()
        return [self.sample_ids[a:b] for a, b in zip(bounds[:-1], bounds[1:])]

    def served_ids(self, batches: int) -> np.ndarray:
        """Ids in the first `batches` batches of every rank: what a position has consumed."""
        if not 0 <= batches <= self.batches_per_rank:
            raise ValueError(
                f"served batches must be in [0, {self.batches_per_rank}], found {batches}"
            )
        firsts = np.arange(self.layout.world_size, dtype=np.int64) * self.batches_per_rank
        begin = self.batch_offsets[firsts]
        end = self.batch_offsets[firsts + batches]
        return gather_runs(self.sample_ids, begin, end - begin)


def _subset_mask(subset, num_samples: int) -> np.ndarray | None:
    if subset is None:
        return None
    arr = np.asarray(subset)
    if arr.dtype == bool:
        if arr.shape != (num_samples,):
            raise ValueError(
                f"a boolean subset must have one entry per sample: found shape {arr.shape}, "
                f"expected ({num_samples},)"
            )
        return arr
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"subset must be a boolean mask or a 1-D array of sample ids, found {arr.dtype} {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() >= num_samples or np.any(np.diff(arr) <= 0)):
        raise ValueError(f"subset ids must be sorted, unique and in [0, {num_samples})")
    mask = np.zeros(num_samples, dtype=bool)
    mask[arr] = True
    return mask


def _check_inputs(lengths, shard_counts, layout, batching, epoch) -> np.ndarray:
    lengths = as_lengths(lengths)
    as_shard_counts(shard_counts, lengths.size)
    if not isinstance(layout, Layout):
        raise ValueError(f"layout must be a Layout, found {type(layout).__name__}")
    if not isinstance(batching, Batching):
        raise ValueError(f"batching must be a Batching, found {type(batching).__name__}")
    if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
        raise ValueError(f"epoch must be an int >= 0, found {epoch!r}")
    if batching.max_tokens is not None and lengths.size:
        over = np.flatnonzero(lengths > batching.max_tokens)
        if over.size:
            # Padding is counted in the budget, so no batch can ever hold it.
            raise ValueError(
                f"sample {int(over[0])} has length {int(lengths[over[0]])}, more than "
                f"max_tokens={batching.max_tokens} ({over.size} such samples); "
                "raise max_tokens or filter these samples out"
            )
    return lengths


def plan_epoch(lengths, shard_counts, layout: Layout, batching: Batching, epoch: int, *, subset=None) -> EpochPlan:
    """Plan one epoch: which samples every rank serves, in which batches, in which order.

    Per node: its sample range (restricted to `subset`, a boolean mask or sorted
    ids), permuted by rng(seed, epoch, node) when shuffling, bucketed by length
    within windows, batch order shuffled. Then every rank gets the same count n
    of batches (see `batches_per_rank`); batches dropped to get there form the
    `remainder`, which changes every epoch. Raises ValueError if n would be 0.
    """
    return plan_subset(lengths, shard_counts, layout, batching, epoch, subset=subset, allow_empty=False)


def plan_subset(
    lengths, shard_counts, layout: Layout, batching: Batching, epoch: int, *, subset=None, allow_empty: bool
) -> EpochPlan:
    """`plan_epoch`, optionally returning a zero-batch plan instead of raising.

    Resuming near the end of an epoch on a new layout may leave too few samples
    for one batch per rank; then the rest of the epoch is the remainder.
    """
    lengths = _check_inputs(lengths, shard_counts, layout, batching, epoch)
    mask = _subset_mask(subset, lengths.size)
    cuts = node_ranges(lengths, layout.num_nodes)
    window = resolve_window(batching, lengths)
    g = layout.ranks_per_node

    nodes = []
    for node in range(layout.num_nodes):
        ids = np.arange(cuts[node], cuts[node + 1], dtype=np.int64)
        if mask is not None:
            ids = ids[mask[cuts[node] : cuts[node + 1]]]
        rng = node_rng(batching, int(epoch), node) if batching.shuffle else None
        nodes.append(bucket(ids, lengths, batching, window, rng))
    node_batches = np.array([starts.size - 1 for _, starts in nodes], dtype=np.int64)
    node_samples = np.array([ids.size for ids, _ in nodes], dtype=np.int64)
    per_rank = batches_per_rank(node_batches, node_samples, g)

    selected = mask.copy() if mask is not None else np.ones(lengths.size, dtype=bool)
    if per_rank == 0:
        if not allow_empty:
            raise ValueError(
                f"dataset too small for this layout: {int(node_samples.sum())} samples in "
                f"{int(node_batches.sum())} batches ({batching}) cannot give each of "
                f"{layout.world_size} ranks ({layout.num_nodes} nodes x {g}) a batch; "
                f"the smallest node holds {int(node_samples.min())} samples for {g} ranks"
            )
        return EpochPlan(
            layout, batching, int(epoch), 0, np.zeros(0, np.int64),
            np.zeros(1, np.int64), np.flatnonzero(selected), 1.0,
        )

    order = deal_order(per_rank, g)
    flat, sizes = [], []
    for node, (ids, starts) in enumerate(nodes):
        begin, end = fit_node(starts, g * per_rank, int(epoch))
        begin, end = begin[order], end[order]
        flat.append(gather_runs(ids, begin, end - begin))
        sizes.append(end - begin)
    sample_ids = np.concatenate(flat)
    batch_sizes = np.concatenate(sizes)
    offsets = np.concatenate([[0], np.cumsum(batch_sizes)]).astype(np.int64)
    selected[sample_ids] = False

    served_lengths = lengths[sample_ids]
    longest = np.maximum.reduceat(served_lengths, offsets[:-1])
    padded = int((longest * batch_sizes).sum())
    efficiency = float(served_lengths.sum()) / padded if padded else 1.0
    return EpochPlan(
        layout, batching, int(epoch), per_rank, sample_ids, offsets, np.flatnonzero(selected), efficiency
    )
