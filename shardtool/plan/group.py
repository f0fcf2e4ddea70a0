"""One data group's epoch: its range's samples → shuffled batches (bucketed by length, or packed
into rows of ``seq_len`` tokens) → exactly k × n of them → dealt to its k DP ranks. Costs
O(the group's share): it reads only its range's lengths."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from .arrays import gather_runs
from .balance import deal_order, fit_group
from .batching import bucket, group_rng
from .cost import row_costs, run_costs
from .costorder import balanced_order
from .packing import Rows, merge_rows, pack_windows
from .rowsplit import split_rows
from .shape import PlanShape
from .source import PlanSource, as_lengths

__all__ = ["GroupPlan", "plan_group"]


@dataclass(frozen=True, eq=False)
class GroupPlan:
    """Local DP rank j's b-th batch is ``ids[offsets[j*n + b] : offsets[j*n + b + 1]]``.

    Packed plans also hold ``rows`` (spans over global ids, in the same dealt order): batch q's
    rows are ``rows`` rows ``row_offsets[q] : row_offsets[q + 1]``, and its ids are the documents
    of its spans, span by span.
    """

    group: int
    size: int  # DP ranks in the group
    batches_per_rank: int
    first: int  # the group's first global sample id
    lengths: np.ndarray  # lengths of the group's samples [first, first + len)
    ids: np.ndarray
    offsets: np.ndarray
    remainder: np.ndarray  # the group's samples of which no rank serves a token this epoch (not no-split's dropped)
    rows: Rows | None = None
    row_offsets: np.ndarray | None = None
    left_out: Rows | None = None  # packed: the rows dropped to reach equal counts (pieces included)

    @property
    def remainder_tokens(self) -> int:
        """Tokens no rank serves this epoch: of the rows left out (packed; the eos counted, as
        packing counts it), or of the remainder's samples. Documents no-split drops for being
        longer than a row are not a remainder (``rows.dropped``)."""
        if self.left_out is not None:
            return self.left_out.tokens
        return int(self.lengths[self.remainder - self.first].sum())

    @property
    def remainder_pieces(self) -> int:
        """Pieces of documents no rank serves this epoch (packed: spans of the rows left out; a
        sample each, unpacked)."""
        return len(self.left_out.span_pos) if self.left_out is not None else int(self.remainder.size)

    @property
    def split_docs(self) -> int:
        """Packed: documents served (or left out) in more than one piece, counted from the spans."""
        if self.rows is None:
            return 0
        pos = np.concatenate([self.rows.span_pos, self.left_out.span_pos])
        return int(np.count_nonzero(np.bincount(pos - self.first, minlength=self.lengths.size) > 1))

    def batch(self, local_rank: int, index: int) -> np.ndarray:
        b = local_rank * self.batches_per_rank + index
        return self.ids[self.offsets[b] : self.offsets[b + 1]]

    def batch_rows(self, local_rank: int, index: int) -> Rows:
        b = local_rank * self.batches_per_rank + index
        return self.rows.slice(int(self.row_offsets[b]), int(self.row_offsets[b + 1]))

    def batch_lengths(self, ids: np.ndarray) -> np.ndarray:
        return self.lengths[ids - self.first]


def plan_group(source: PlanSource, shape: PlanShape, group: int, epoch: int) -> GroupPlan:
    """Group ``group``'s plan for ``epoch``: permuted by rng(seed, epoch, group) when shuffling,
    bucketed by length (or packed) within windows, batch order shuffled, fitted to k × n
    batches, dealt."""
    if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
        raise ValueError(f"epoch must be an int >= 0, found {epoch!r}")
    batching = shape.batching
    lo, hi = int(shape.cuts[group]), int(shape.cuts[group + 1])
    lengths = as_lengths(source.lengths_range(lo, hi))
    if lengths.size != hi - lo:
        raise ValueError(f"the plan source gave {lengths.size} lengths for samples [{lo}, {hi})")
    if batching.max_tokens is not None and lengths.size and int(lengths.max()) > batching.max_tokens:
        bad = int(np.argmax(lengths))
        raise ValueError(
            f"sample {lo + bad} has length {int(lengths[bad])}, more than max_tokens="
            f"{batching.max_tokens}; raise max_tokens or filter these samples out"
        )
    k = shape.data_layout.group_sizes[group]
    n = shape.batches_per_rank
    ids = np.arange(lo, hi, dtype=np.int64)
    rng = group_rng(batching, int(epoch), group, shape.data_layout.num_groups) if batching.shuffle else None
    if batching.packing is not None:
        return _packed(shape, group, int(epoch), lo, lengths, ids, rng, k, n)
    ordered, starts = bucket(ids, lengths, batching, shape.window, rng)
    if starts.size - 1 > k * n and _serves_all(batching, shape):
        # Windows cut more batches than the count: sorted as one window the group needs the
        # fewest, which the count of one group is never short of (`shape._one_window_batches`).
        ordered, starts = bucket(ids, lengths, batching, ids.size, rng)
    if n == 0:
        return GroupPlan(group, k, 0, lo, lengths, np.zeros(0, np.int64), np.zeros(1, np.int64), ids)
    if batching.exact and starts.size - 1 > k * n:
        raise RuntimeError(f"exact plan: group {group} cut {starts.size - 1} batches, more than its {k} x {n}")
    begin, end = fit_group(starts, k * n, int(epoch), pad=batching.exact)
    if batching.balance is not None:
        runs = np.concatenate([[0], np.cumsum(end - begin)]).astype(np.int64)
        cost = run_costs(lengths[gather_runs(ordered, begin, end - begin) - lo], runs, batching.balance)
        order, _ = balanced_order(
            cost,
            k,
            n,
            1,
            batching.seed,
            _order_epoch(batching, epoch),
            batching.balance_window,
            batching.micro_batches or 1,
        )
    else:
        order = deal_order(n, k, batching.run_batches)
    begin, end = begin[order], end[order]
    kept = gather_runs(ordered, begin, end - begin)
    offsets = np.concatenate([[0], np.cumsum(end - begin)]).astype(np.int64)
    served = np.zeros(hi - lo, dtype=bool)
    served[kept - lo] = True
    return GroupPlan(group, k, n, lo, lengths, kept, offsets, ids[~served])


def _serves_all(batching, shape: PlanShape) -> bool:
    """A token budget's bucketed batches that must serve every sample (``drop_last`` false)."""
    return (
        batching.max_tokens is not None
        and batching.bucketing
        and batching.shuffle_block is None
        and not batching.drops(shape.data_layout.dp_size)
    )


def _packed(
    shape: PlanShape, group: int, epoch: int, lo: int, lengths: np.ndarray, ids: np.ndarray, rng, k: int, n: int
) -> GroupPlan:
    """Windows of the (permuted) group packed into rows; rows shuffled; exactly k × n batches of
    at most batch_size rows: surplus rows dropped (a window that moves with the epoch), or, short
    of rows, the batches share them out evenly (the loader pads a short batch with empty rows),
    the fullest rows cut in parts where there are fewer rows than batches."""
    packing, per_batch = shape.batching.packing, shape.batching.batch_size
    count = ids.size
    stream = packing.policy == "stream"
    if rng is not None and not stream:
        perm = rng.permutation(count)
        ids, window_lengths = ids[perm], lengths[perm]
    else:
        window_lengths = lengths
    # stream: the group's stored token stream is cut as one window, so a row is a run of
    # neighbouring documents the reader copies in one piece; only rows are shuffled.
    rows = pack_windows(window_lengths, ids, packing, shape.window)
    order = rng.permutation(rows.num_rows) if rng is not None else np.arange(rows.num_rows)
    target = k * n
    rows = rows.take(order)
    if rows.num_rows > target * per_batch and not shape.batching.drops(shape.data_layout.dp_size):
        rows = _absorb_surplus(rows, target * per_batch, packing)
    have = rows.num_rows
    if have > target * per_batch:
        if shape.batching.exact:
            raise RuntimeError(f"exact plan: group {group} packed {have} rows, more than its {target} x {per_batch}")
        surplus = have - target * per_batch
        drop = np.zeros(have, dtype=bool)
        drop[(epoch * surplus + np.arange(surplus)) % have] = True
        left_out = rows.take(np.flatnonzero(drop))
        rows = rows.take(np.flatnonzero(~drop))
    else:
        left_out = rows.take(np.zeros(0, np.int64))
    if rows.num_rows < target:  # fewer rows than batches: cut the fullest, as bucketing splits batches
        rows = split_rows(rows, target, whole_docs=packing.policy == "no-split")
    # Rows per batch: full batches, or (short of rows) shared out evenly over all target batches.
    sizes = (
        np.full(target, per_batch, np.int64)
        if rows.num_rows == target * per_batch
        else np.diff((np.arange(target + 1, dtype=np.int64) * rows.num_rows) // max(target, 1))
    )
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    model = shape.batching.balance
    if model is not None and n:
        # Rows of like cost make each step (`costorder`); a group short of rows leaves the gaps
        # spread over the steps, at most per_batch - 1 a batch, as the plain deal does.
        order, row_count = balanced_order(
            row_costs(rows, model),
            k,
            n,
            per_batch,
            shape.batching.seed,
            _order_epoch(shape.batching, epoch),
            shape.batching.balance_window,
            shape.batching.micro_batches or 1,
        )
        rows = rows.take(order)
    else:
        dealt = deal_order(n, k)
        row_begin, row_count = starts[:-1][dealt], sizes[dealt]
        rows = rows.take(gather_runs(np.arange(rows.num_rows, dtype=np.int64), row_begin, row_count))
    row_offsets = np.concatenate([[0], np.cumsum(row_count)]).astype(np.int64)
    rows, left_out = in_serving_order(rows, row_offsets, left_out, k, n)
    span_offsets = rows.row_offsets[row_offsets]
    served = np.zeros(count, dtype=bool)
    served[rows.span_pos - lo] = True
    served[np.union1d(rows.dropped, left_out.dropped) - lo] = True  # no-split's too long: not a remainder
    all_ids = np.arange(lo, lo + count, dtype=np.int64)
    return GroupPlan(
        group, k, n, lo, lengths, rows.span_pos, span_offsets, all_ids[~served], rows, row_offsets, left_out
    )


def _absorb_surplus(rows: Rows, capacity: int, packing) -> Rows:
    """``rows`` (in served order) in at most ``capacity`` rows, every token kept: the least full
    rows, as few as it takes, merged (`merge_rows`: laid end to end and cut every seq_len
    tokens), the merged rows taking the first of their places. Unchanged where even merging every
    row cannot fit (more tokens than the capacity: a shape estimated from pro-rata shard cuts);
    the rows of equal counts then drop the rest as a reported remainder."""
    have, seq = rows.num_rows, rows.seq_len
    by_fill = np.argsort(rows.row_tokens(), kind="stable")
    filled = np.cumsum(rows.row_tokens()[by_fill])
    # Merging the m least full rows saves m - ceil(tokens / seq) rows, non-decreasing in m.
    saved = np.arange(1, have + 1) - (-(-filled // seq))
    m = int(np.searchsorted(saved, have - capacity, side="left")) + 1
    while m <= have:
        chosen = np.sort(by_fill[:m])
        merged = merge_rows(rows.take(chosen), packing)
        if have - m + merged.num_rows <= capacity:
            keep = np.ones(have, dtype=bool)
            keep[chosen] = False
            slot = np.full(have, -1, np.int64)  # served position -> merged row, or -1: an old row
            slot[chosen[: merged.num_rows]] = np.arange(merged.num_rows)
            keep[chosen[: merged.num_rows]] = True
            places = np.flatnonzero(keep)
            # Rows of [rows, merged]: an old row where it was, else the merged row of its place.
            return Rows.concat([rows, merged], seq).take(np.where(slot[places] >= 0, have + slot[places], places))
        if m == have:
            break
        m = min(have, 2 * m)  # the piece bound closed merged rows early: merge more
    return rows


def in_serving_order(rows: Rows, row_offsets: np.ndarray, left_out: Rows, k: int, n: int) -> tuple[Rows, Rows]:
    """The pieces of every split document re-cut so that they are served head first.

    Rows are served at (step b, local DP rank j, row r of the batch): rank j's batch b in the
    same step b on every rank. A document's spans keep their lengths and their places (so every
    row keeps its tokens), but their offsets are reassigned in that order: the first-served span
    holds the document's first tokens, the next the tokens after them, and so on; spans left out
    (drop_last) come last, so what is not served is the document's end. ``rows`` are dealt (rank
    j's batches j*n .. j*n + n - 1 of ``row_offsets``)."""
    batch = np.repeat(np.arange(k * n, dtype=np.int64), np.diff(row_offsets))
    rank, step = batch // max(n, 1), batch % max(n, 1)
    within = np.arange(rows.num_rows, dtype=np.int64) - row_offsets[batch]
    row_key = (step * k + rank) * (int(np.diff(row_offsets).max(initial=0)) + 1) + within
    span_key = np.repeat(row_key, np.diff(rows.row_offsets))
    late = int(row_key.max(initial=0)) + 1
    pos = np.concatenate([rows.span_pos, left_out.span_pos])
    size = np.concatenate([rows.span_len, left_out.span_len])
    key = np.concatenate([span_key, late + np.arange(len(left_out.span_pos), dtype=np.int64)])
    order = np.lexsort((key, pos))
    before = np.cumsum(size[order]) - size[order]
    first = np.ones(len(order), dtype=bool)
    first[1:] = pos[order][1:] != pos[order][:-1]
    base = np.maximum.accumulate(np.where(first, before, 0))
    start = np.empty(len(order), np.int64)
    start[order] = before - base
    cut = len(rows.span_pos)
    return (
        dataclasses.replace(rows, span_start=start[:cut]),
        dataclasses.replace(left_out, span_start=start[cut:]),
    )


def _order_epoch(batching, epoch: int) -> int:
    """The epoch a balanced deal draws its step order from: unshuffled, every epoch is served in
    the same (balanced, so not the dataset's) order."""
    return int(epoch) if batching.shuffle else 0
