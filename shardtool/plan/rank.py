"""One DP rank's batches: the plan a training rank computes at start-up, at each epoch and on resume.

`Planner` holds the per-layout `PlanShape`s (from the summaries) and the `GroupPlan`s a rank
needs — its own group's, and after an elastic resume the groups its re-dealt batches come from —
so a rank's cost stays about its own share of the data. See `shardtool.plan.state` for the
segment rule.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .arrays import gather_runs
from .batching import Batching
from .group import GroupPlan, plan_group
from .keptlengths import KeptLengths
from .layout import DataLayout
from .packing import Rows
from .shape import PlanShape, plan_shape, shard_namer
from .source import PlanSource
from .state import LoaderState, Segment, StateError

__all__ = ["Planner", "RankPlan", "first_segment_batches"]


@dataclass(frozen=True, eq=False)
class RankPlan:
    """DP rank ``dp_rank``'s batches in the current segment of ``epoch``: batch i is
    ``ids[offsets[i] : offsets[i + 1]]``; ``lengths`` are the lengths of ``ids``."""

    epoch: int
    dp_rank: int
    batches_per_rank: int
    ids: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    remainder: np.ndarray | None  # the rank's group's unserved samples (segment 0), else None
    leftover_batches: int  # batches no rank serves because a re-deal did not divide evenly
    rows: Rows | None = None  # packed: every batch's rows; batch i is rows row_offsets[i]:row_offsets[i+1]
    row_offsets: np.ndarray | None = None
    # With ``remainder`` (segment 0): the tokens and pieces of documents of the rank's group no rank
    # serves (packed rows leave out pieces, a document can lose some and keep the rest).
    remainder_tokens: int | None = None
    remainder_pieces: int | None = None
    # Exact plans (`Batching.exact`), per batch: whether it is padding, one sample (bucketed) or no
    # row (packed) that no metric may count; a rank short of batches serves these. None otherwise.
    pad: np.ndarray | None = None

    def batch_rows(self, i: int) -> Rows:
        return self.rows.slice(int(self.row_offsets[i]), int(self.row_offsets[i + 1]))

    def taking(self, positions: np.ndarray) -> RankPlan:
        """This plan's batches at ``positions`` only, in that order (a pass past skipped steps)."""
        positions = np.asarray(positions, dtype=np.int64)
        sizes = np.diff(self.offsets)[positions]
        ids_at = gather_runs(np.arange(self.ids.size, dtype=np.int64), self.offsets[positions], sizes)
        rows = row_offsets = None
        if self.rows is not None:
            counts = np.diff(self.row_offsets)[positions]
            rows = self.rows.take(gather_runs(np.arange(self.rows.num_rows), self.row_offsets[positions], counts))
            row_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return dataclasses.replace(
            self,
            batches_per_rank=int(positions.size),
            ids=self.ids[ids_at],
            offsets=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
            lengths=self.lengths[ids_at],
            rows=rows,
            row_offsets=row_offsets,
            pad=self.pad[positions] if self.pad is not None else None,
        )

    def grouped(self, bounds: np.ndarray) -> RankPlan:
        """This plan's batches ``bounds[j] .. bounds[j + 1] - 1`` as its batch j (the steps of a
        batch-size schedule, `shardtool.plan.schedule`): consecutive batches, so views."""
        bounds = np.asarray(bounds, dtype=np.int64)
        if self.pad is not None:
            raise ValueError("an exact plan's padding batches cannot be grouped")
        return dataclasses.replace(
            self,
            batches_per_rank=int(bounds.size - 1),
            offsets=self.offsets[bounds],
            row_offsets=self.row_offsets[bounds] if self.row_offsets is not None else None,
        )

    def packed_stats(self, rows_per_batch: int | np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Packed, per batch: pieces, real tokens, tokens of its rows_per_batch rows (one number,
        or one per batch)."""
        spans = np.diff(self.rows.row_offsets[self.row_offsets])
        before = np.concatenate([[0], np.cumsum(self.rows.span_len)])
        tokens = (
            before[self.rows.row_offsets[self.row_offsets[1:]]] - before[self.rows.row_offsets[self.row_offsets[:-1]]]
        )
        padded = np.broadcast_to(
            np.asarray(rows_per_batch, dtype=np.int64) * self.rows.seq_len, (self.batches_per_rank,)
        )
        return spans, tokens, padded.copy()

    @property
    def fill_rate(self) -> float:
        """Packed: real tokens / row tokens over this rank's batches (rows_per_batch rows each)."""
        if self.rows is None or not self.batches_per_rank:
            return 1.0
        per_batch = max(int(np.diff(self.row_offsets).max(initial=1)), 1)
        return self.rows.tokens / (self.batches_per_rank * per_batch * self.rows.seq_len)

    def batches(self, start: int = 0) -> list[np.ndarray]:
        """The batches from ``start`` on, each an array of global sample ids (views, not copies)."""
        bounds = self.offsets[start:].tolist()
        return [self.ids[a:b] for a, b in zip(bounds[:-1], bounds[1:])]

    def batch(self, i: int) -> np.ndarray:
        if not 0 <= i < self.batches_per_rank:
            raise ValueError(f"batch index must be in [0, {self.batches_per_rank}), found {i}")
        return self.ids[self.offsets[i] : self.offsets[i + 1]]

    @property
    def padding_efficiency(self) -> float:
        if not self.batches_per_rank:
            return 1.0
        sizes = np.diff(self.offsets)
        lengths = np.maximum(self.lengths, 0)
        full = sizes > 0  # a no-split plan short of documents has empty batches
        longest = np.maximum.reduceat(lengths, self.offsets[:-1][full]) if lengths.size else np.zeros(0, np.int64)
        padded = int((longest * sizes[full]).sum())
        return float(lengths.sum()) / padded if padded else 1.0


def _in_rank_order(
    parts: list[Rows], counts: list[np.ndarray], where: list[np.ndarray], n: int, seq_len: int
) -> tuple[Rows, np.ndarray]:
    """The rows of a rank's n batches, gathered group by group, put back in the rank's order."""
    every = Rows.concat(parts, seq_len)
    sizes = np.concatenate(counts) if counts else np.zeros(0, np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) if sizes.size else sizes
    position = np.concatenate(where) if where else np.zeros(0, np.int64)
    order = np.argsort(position, kind="stable")  # rank batch p comes from gathered batch order[p]
    rows = every.take(gather_runs(np.arange(every.num_rows, dtype=np.int64), starts[order], sizes[order]))
    return rows, np.concatenate([[0], np.cumsum(sizes[order])]).astype(np.int64)


def _in_previous(segments: list[Segment], i: int, position: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(DP rank, batch) in segment i-1 of positions in segment i's sequence: segment i-1's
    unserved batches (not those skipped), DP rank by DP rank."""
    prev = segments[i - 1]
    left = max(prev.left, 1)
    if not prev.skipped:
        return position // left, prev.served + position % left
    unserved = prev.unserved()
    return position // left, unserved[position % left] if unserved.size else position % left


def to_first_segment(
    segments: list[Segment], i: int, d: np.ndarray, b: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where DP rank d's batch b of segment ``i`` comes from: (DP rank, batch) in segment 0, and
    whether it is padding (an exact re-deal's batch past what the segment before left; its
    (DP rank, batch) is then a stand-in, batch 0 of DP rank 0)."""
    pad = np.zeros(d.size, dtype=bool)
    for j in range(i, 0, -1):
        position = d * segments[j].batches + b
        pad |= position >= segments[j - 1].layout.dp_size * segments[j - 1].left
        d, b = _in_previous(segments, j, np.where(pad, 0, position))
    return np.where(pad, 0, d), np.where(pad, 0, b), pad


def first_segment_batches(segments: list[Segment], j: int, dp_rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where DP rank ``dp_rank``'s batches of segment ``j`` come from, in segment 0 (and which
    are an exact re-deal's padding)."""
    n = segments[j].batches
    return to_first_segment(segments, j, np.full(n, dp_rank, dtype=np.int64), np.arange(n, dtype=np.int64))


def _redeal(prev: Segment, layout: DataLayout, exact: bool = False) -> tuple[int, int]:
    """(batches per DP rank, batches left over) when ``prev``'s unserved batches go to ``layout``.
    Exact plans leave none over: the ranks short of a batch serve padding instead."""
    remaining = prev.layout.dp_size * prev.left
    if exact:
        return -(-remaining // layout.dp_size), 0
    n = remaining // layout.dp_size
    return n, remaining - n * layout.dp_size


class Planner:
    """Plans of one dataset and batching config; cheap to keep for the life of a loader."""

    MAX_GROUPS = 8  # group plans kept: a rank's own, and the few an elastic resume draws from

    def __init__(self, source: PlanSource, batching: Batching):
        self.source = source
        self._source = KeptLengths(source)
        self.batching = batching
        self._shapes: dict[str, PlanShape] = {}
        self._groups: OrderedDict[tuple, GroupPlan] = OrderedDict()

    def shape(self, layout: DataLayout) -> PlanShape:
        key = repr(layout.identity())
        shape = self._shapes.get(key)
        if shape is None:
            shape = self._shapes[key] = plan_shape(
                self.source.summaries, layout, self.batching, self._source.lengths_range, shard_namer(self.source)
            )
        return shape

    def group(self, layout: DataLayout, group: int, epoch: int) -> GroupPlan:
        key = (repr(layout.identity()), group, epoch)
        plan = self._groups.get(key)
        if plan is None:
            plan = plan_group(self._source, self.shape(layout), group, epoch)
            self._groups[key] = plan
            while len(self._groups) > self.MAX_GROUPS:
                self._groups.popitem(last=False)
        else:
            self._groups.move_to_end(key)
        return plan

    def expect_lengths(self, layout: DataLayout, group: int, read: Callable[[int, int], Any]) -> None:
        """``group``'s lengths on ``layout`` are being read (``read(lo, hi)`` starts the read of
        samples [lo, hi) and returns what its ``result()`` gives): its plan waits for that read
        instead of reading them again. A loader starts it when it is made, behind the trainer's
        set-up; the planner itself reads nothing in the background."""
        cuts = self.shape(layout).cuts
        self._source.expect(int(cuts[group]), int(cuts[group + 1]), read)

    # ------------------------------------------------------------------ states
    def start(self, epoch: int, dataset_fingerprint: str, layout: DataLayout) -> LoaderState:
        """The state before the first batch of ``epoch`` on ``layout``."""
        return LoaderState.start(epoch, dataset_fingerprint, self.batching, layout, self.shape(layout).batches_per_rank)

    def continue_on(self, state: LoaderState, layout: DataLayout) -> LoaderState:
        """``state`` continued on ``layout``: the same segment, or a new one dealing what is left."""
        if not state.segments:
            return LoaderState.start(
                state.epoch, state.dataset_fingerprint, self.batching, layout, self.shape(layout).batches_per_rank
            )
        if state.same_layout(layout):
            return state.copy()
        trimmed = state.copy()
        # A segment in which nothing was served changed nothing: deal from the one before it, or
        # plan the epoch afresh on the new layout (node-sticky ranges, no batch left over).
        while trimmed.segments and trimmed.last.served == 0 and not trimmed.last.skipped:
            trimmed.segments.pop()
        if not trimmed.segments:
            return LoaderState.start(
                state.epoch, state.dataset_fingerprint, self.batching, layout, self.shape(layout).batches_per_rank
            )
        if trimmed.same_layout(layout):
            return trimmed
        n, _ = _redeal(trimmed.last, layout, self.batching.exact)
        return trimmed.resumed_on(layout, n)

    def check(self, state: LoaderState) -> None:
        """Every segment's batch count is what this dataset and config give: else the state was
        saved for something else (another dataset version, config or planner)."""
        for i, seg in enumerate(state.segments):
            if i == 0:
                want = self.shape(seg.layout).batches_per_rank
            else:
                want, _ = _redeal(state.segments[i - 1], seg.layout, self.batching.exact)
            if seg.batches != want:
                raise StateError(
                    f"segment {i} of the loader state has {seg.batches} batches per rank where "
                    f"this dataset and config give {want}: found a state from another dataset or config, or planned "
                    "by another shardtool version"
                )

    def _batch_ids(self, layout0: DataLayout, epoch: int, d0: np.ndarray, b0: np.ndarray) -> list[np.ndarray]:
        firsts = np.cumsum([0, *layout0.group_sizes])
        group = np.searchsorted(firsts, d0, side="right") - 1
        out: list[np.ndarray] = []
        for g, d, b in zip(group.tolist(), d0.tolist(), b0.tolist()):
            out.append(self.group(layout0, g, epoch).batch(d - int(firsts[g]), b))
        return out

    def left_over(self, state: LoaderState) -> list[np.ndarray]:
        """The batches of the epoch that the re-deals of ``state``'s segments left to no rank
        (fewer than the new DP size each time). For tools and tests: it may plan many groups."""
        segments = state.segments
        if not segments:
            return []
        layout0 = segments[0].layout
        out: list[np.ndarray] = []
        for i in range(1, len(segments)):
            layout = segments[i].layout
            n, extra = _redeal(segments[i - 1], layout, self.batching.exact)
            position = np.arange(n * layout.dp_size, n * layout.dp_size + extra, dtype=np.int64)
            d, b = _in_previous(segments, i, position)
            d0, b0, _ = to_first_segment(segments, i - 1, d, b)
            out += self._batch_ids(layout0, state.epoch, d0, b0)
        return out

    # ------------------------------------------------------------------ one rank
    def rank_plan(self, state: LoaderState, dp_rank: int) -> RankPlan:
        """DP rank ``dp_rank``'s batches in ``state``'s current (last) segment, from batch 0."""
        segments = state.segments
        j = len(segments) - 1
        segments[j].layout.group_of(dp_rank)  # a DP rank of the current layout
        layout0 = segments[0].layout
        d0, b0, redealt_pad = first_segment_batches(segments, j, dp_rank)
        firsts = np.cumsum([0, *layout0.group_sizes])
        group = np.searchsorted(firsts, d0, side="right") - 1
        n = segments[j].batches
        pieces = []  # per source group: (positions in this rank's order, their ids, sizes, lengths)
        row_parts, row_counts, row_where = [], [], []  # packed: the same batches' rows
        for g in np.unique(group[~redealt_pad]).tolist():
            plan = self.group(layout0, g, state.epoch)
            where = np.flatnonzero((group == g) & ~redealt_pad)
            index = (d0[where] - firsts[g]) * plan.batches_per_rank + b0[where]
            starts, stops = plan.offsets[index], plan.offsets[index + 1]
            got = gather_runs(plan.ids, starts, stops - starts)
            pieces.append((where, got, stops - starts, plan.batch_lengths(got)))
            if plan.rows is not None:
                first, count = plan.row_offsets[index], plan.row_offsets[index + 1] - plan.row_offsets[index]
                row_parts.append(plan.rows.take(gather_runs(np.arange(plan.rows.num_rows), first, count)))
                row_counts.append(count)
                row_where.append(where)
        size = np.zeros(n, dtype=np.int64)
        for where, _, counts, _ in pieces:
            size[where] = counts
        offsets = np.concatenate([[0], np.cumsum(size)]).astype(np.int64)
        ids = np.empty(int(offsets[-1]), dtype=np.int64)
        lengths = np.empty_like(ids)
        for where, got, counts, got_lengths in pieces:
            dest = gather_runs(np.arange(ids.size, dtype=np.int64), offsets[where], counts)
            ids[dest], lengths[dest] = got, got_lengths
        leftover = sum(_redeal(segments[i - 1], segments[i].layout, self.batching.exact)[1] for i in range(1, j + 1))
        remainder = remainder_tokens = remainder_pieces = None
        if j == 0:
            g, _ = layout0.group_of(dp_rank)
            own = self.group(layout0, g, state.epoch)
            remainder, remainder_tokens, remainder_pieces = own.remainder, own.remainder_tokens, own.remainder_pieces
        rows = row_offsets = pad = None
        if self.batching.packing is not None:
            if redealt_pad.any():  # no rows: the loader's padding rows make the batch
                row_parts.append(Rows.concat([], self.batching.packing.seq_len))
                row_counts.append(np.zeros(int(redealt_pad.sum()), np.int64))
                row_where.append(np.flatnonzero(redealt_pad))
            rows, row_offsets = _in_rank_order(row_parts, row_counts, row_where, n, self.batching.packing.seq_len)
        if self.batching.exact:
            pad = size == 0
            if self.batching.packing is None and pad.any():
                ids, lengths, offsets = self._padded(ids, lengths, offsets, pad, layout0, dp_rank)
        return RankPlan(
            state.epoch,
            dp_rank,
            n,
            ids,
            offsets,
            lengths,
            remainder,
            leftover,
            rows,
            row_offsets,
            remainder_tokens,
            remainder_pieces,
            pad,
        )

    def _padded(
        self,
        ids: np.ndarray,
        lengths: np.ndarray,
        offsets: np.ndarray,
        pad: np.ndarray,
        layout0: DataLayout,
        dp_rank: int,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Bucketed padding batches given one sample each: the rank's first real one, else its
        group's first (a sample its node reads anyway), so every batch collates as usual."""
        if ids.size:
            stand_in, length = int(ids[0]), int(lengths[0])
        else:
            g, _ = layout0.group_of(min(dp_rank, layout0.dp_size - 1))
            total = int(np.asarray(self.source.summaries.samples).sum())
            stand_in = min(int(self.shape(layout0).cuts[g]), total - 1)
            length = int(np.asarray(self.source.lengths_range(stand_in, stand_in + 1))[0])
        sizes = np.diff(offsets)
        sizes[pad] = 1
        new_offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        new_ids = np.full(int(new_offsets[-1]), stand_in, dtype=np.int64)
        new_lengths = np.full(new_ids.size, length, dtype=np.int64)
        real = gather_runs(np.arange(new_ids.size, dtype=np.int64), new_offsets[:-1][~pad], sizes[~pad])
        new_ids[real], new_lengths[real] = ids, lengths
        return new_ids, new_lengths, new_offsets
