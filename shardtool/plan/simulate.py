"""Every data group's plan of an epoch at once: what `shardtool plan` reports for a layout.

A training rank never does this (it plans its own group); a simulation plans every group, one
at a time so memory stays one group's, optionally in several processes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .batching import Batching
from .cost import CostModel, batch_costs, step_balance
from .forked import forked_map
from .group import plan_group
from .layout import DataLayout
from .packing import piece_cap_note
from .shape import PlanShape, plan_shape, shard_namer
from .source import PlanSource

__all__ = ["GroupStats", "Simulation", "simulate_epoch"]


@dataclass(frozen=True)
class GroupStats:
    group: int
    samples: int
    tokens: int
    served_samples: int
    served_tokens: int
    padded_tokens: int
    samples_per_rank: tuple[int, ...]
    split_docs: int = 0  # packed: documents cut into pieces
    dropped_docs: int = 0  # packed, no-split: documents longer than a row, left out
    remainder_pieces: int = 0  # packed: pieces of documents in the rows left out for equal counts
    costs: np.ndarray | None = None  # with a cost model: [DP ranks of the group, steps], each batch's cost
    padding_batches: int = 0  # exact plans: batches that only pad a rank's count (no real sample)
    rows: int = 0  # packed: rows served
    # Real tokens of each batch position of the epoch, summed over the group's DP ranks (what a
    # schedule's step takes together: `shardtool plan` reports each phase's tokens from it).
    position_tokens: np.ndarray | None = None
    capped_rows: int = 0  # packed: rows closed at max_docs_per_row pieces


@dataclass(frozen=True, eq=False)
class Simulation:
    shape: PlanShape
    groups: list[GroupStats]

    @property
    def remainder_samples(self) -> int:
        return sum(g.samples - g.served_samples for g in self.groups)

    @property
    def remainder_tokens(self) -> int:
        return sum(g.tokens - g.served_tokens for g in self.groups)

    @property
    def position_tokens(self) -> np.ndarray:
        """Real tokens of each batch position of the epoch over every DP rank."""
        return np.sum([g.position_tokens for g in self.groups if g.position_tokens is not None], axis=0)

    def piece_cap_note(self) -> str | None:
        """Packed: `shardtool.plan.packing.piece_cap_note` over every group's rows."""
        packing = self.shape.batching.packing
        if packing is None:
            return None
        rows = sum(g.rows for g in self.groups)
        capped = sum(g.capped_rows for g in self.groups)
        return piece_cap_note(capped, rows, sum(g.served_tokens for g in self.groups), packing)

    @property
    def remainder_pieces(self) -> int:
        return sum(g.remainder_pieces for g in self.groups)

    @property
    def total_tokens(self) -> int:
        return sum(g.tokens for g in self.groups)

    @property
    def remainder_tokens_fraction(self) -> float:
        return self.remainder_tokens / self.total_tokens if self.total_tokens else 0.0

    @property
    def padding_efficiency(self) -> float:
        padded = sum(g.padded_tokens for g in self.groups)
        return sum(g.served_tokens for g in self.groups) / padded if padded else 1.0

    @property
    def fill_rate(self) -> float:
        """Packed: real tokens / tokens of the rows (padded batches of batch_size rows)."""
        return self.padding_efficiency

    @property
    def split_docs(self) -> int:
        return sum(g.split_docs for g in self.groups)

    @property
    def padding_batches(self) -> int:
        return sum(g.padding_batches for g in self.groups)

    @property
    def dropped_docs(self) -> int:
        return sum(g.dropped_docs for g in self.groups)

    @property
    def samples_per_rank(self) -> np.ndarray:
        return np.array([s for g in self.groups for s in g.samples_per_rank], dtype=np.int64)

    @property
    def step_costs(self) -> np.ndarray | None:
        """With a cost model: every DP rank's batch costs, [DP ranks, steps] (group after group)."""
        parts = [g.costs for g in self.groups]
        return np.concatenate(parts) if parts and all(p is not None for p in parts) else None

    def balance(self, micro: int = 1) -> dict | None:
        """With a cost model: `shardtool.plan.cost.step_balance` of the epoch's steps (of ``micro``
        batches a rank; default the config's ``micro_batches``)."""
        costs = self.step_costs
        micro = self.shape.batching.micro_batches or micro
        return step_balance(costs, micro) if costs is not None else None


def _stats(
    source: PlanSource,
    shape: PlanShape,
    group: int,
    epoch: int,
    cost: CostModel | None = None,
    cut: np.ndarray | None = None,
) -> GroupStats:
    plan = plan_group(source, shape, group, epoch)
    width = shape.batching.batch_size if plan.rows is not None else None
    costs = batch_costs(plan, cost, width, cut if plan.rows is not None else None) if cost else None
    if plan.rows is not None:
        return _packed_stats(plan, shape, costs)
    lengths = plan.batch_lengths(plan.ids)
    sizes = np.diff(plan.offsets)
    padded = 0
    full = sizes > 0  # an exact plan's padding batches are empty here
    if lengths.size:
        longest = np.maximum.reduceat(np.maximum(lengths, 1), plan.offsets[:-1][full])
        padded = int((longest * sizes[full]).sum())
    n = plan.batches_per_rank
    per_rank = tuple(int(plan.offsets[(j + 1) * n] - plan.offsets[j * n]) for j in range(plan.size))
    before = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    by_batch = before[plan.offsets[1:]] - before[plan.offsets[:-1]]
    return GroupStats(
        group,
        int(plan.lengths.size),
        int(plan.lengths.sum()),
        int(plan.ids.size),
        int(lengths.sum()),
        padded,
        per_rank,
        costs=costs,
        padding_batches=int(np.count_nonzero(sizes == 0)),
        position_tokens=by_batch.reshape(plan.size, n).sum(axis=0) if n else np.zeros(0, np.int64),
    )


def _packed_stats(plan, shape: PlanShape, costs: np.ndarray | None) -> GroupStats:
    """Tokens count the eos packing adds; the remainder is the rows dropped for equal counts (no-split's
    over-long documents are counted apart, as dropped)."""
    packing, per_batch = shape.batching.packing, shape.batching.batch_size
    rows, left = plan.rows, plan.left_out
    served = rows.tokens
    n, k = plan.batches_per_rank, plan.size
    row_before = np.concatenate([[0], np.cumsum(rows.row_tokens())]).astype(np.int64)
    by_batch = row_before[plan.row_offsets[1:]] - row_before[plan.row_offsets[:-1]]
    per_rank = tuple(int(plan.row_offsets[(j + 1) * n] - plan.row_offsets[j * n]) for j in range(k))
    return GroupStats(
        plan.group,
        int(plan.lengths.size),
        served + left.tokens,
        int(np.unique(rows.span_pos).size),
        served,
        k * n * per_batch * packing.seq_len,
        per_rank,
        split_docs=plan.split_docs,
        remainder_pieces=plan.remainder_pieces,
        dropped_docs=int(np.union1d(rows.dropped, left.dropped).size),  # both carry the group's (`Rows.take`)
        costs=costs,
        padding_batches=int(np.count_nonzero(np.diff(plan.row_offsets) == 0)),
        rows=rows.num_rows,
        position_tokens=by_batch.reshape(k, n).sum(axis=0) if n else np.zeros(0, np.int64),
        capped_rows=rows.at_piece_cap(packing),
    )


def _group_stats(work: tuple, group: int) -> GroupStats:
    source, shape, epoch, cost, cut = work
    return _stats(source, shape, group, epoch, cost, cut)


def simulate_epoch(
    source: PlanSource,
    layout: DataLayout,
    batching: Batching,
    epoch: int = 0,
    *,
    processes: int = 1,
    cost_model: CostModel | None = None,
    seq_lens_of: Callable[[int], np.ndarray] | None = None,
) -> Simulation:
    """Every group's plan of ``epoch``; with ``cost_model``, each batch's cost too (`Simulation.balance`),
    under a sequence-length warmup of its rows cut to ``seq_lens_of(batches per rank)`` (one
    length per batch of a rank: that of the step that serves it)."""
    shape = plan_shape(source.summaries, layout, batching, source.lengths_range, shard_namer(source))
    groups = list(range(layout.num_groups))
    cut = seq_lens_of(shape.batches_per_rank) if seq_lens_of is not None and cost_model is not None else None
    # Forked processes inherit the source (a dataset with open files and locks) instead of receiving it pickled.
    work = (source, shape, epoch, cost_model, cut)
    stats = forked_map(_group_stats, work, groups, processes, chunksize=len(groups) // (8 * max(processes, 1)))
    return Simulation(shape, stats)


def epoch_remainder(source: PlanSource, layout: DataLayout, batching: Batching, epoch: int = 0) -> np.ndarray:
    """Global ids of the samples no rank serves in ``epoch`` (every group's remainder, sorted)."""
    shape = plan_shape(source.summaries, layout, batching, source.lengths_range, shard_namer(source))
    parts = [plan_group(source, shape, g, epoch).remainder for g in range(layout.num_groups)]
    return np.sort(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
