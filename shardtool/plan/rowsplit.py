"""Split packed rows into more, shorter rows: the packed twin of splitting a deficit group's batches.

A group whose windows packed fewer rows than it owes batches (few tokens, one row a batch, many DP
ranks) must still hand every batch at least one real token, without dropping any: its fullest rows
are cut into near-equal parts, at token positions (a cut may fall inside a document, as ``concat``
cuts documents anyway) — or, for ``no-split`` packing, only between documents, at the boundaries
nearest the even cuts: a row of one document stays whole, and the group is then short of rows
(its batches share the rows there are). Rare, and small when it happens, so plain Python is fine.

`cut_rows` is the other cut: every row into rows of a fixed shorter length, at multiples of it (a
sequence-length schedule's short steps, `shardtool.plan.schedule`). It runs on every such step,
so it is vectorised.
"""

from __future__ import annotations

import heapq

import numpy as np

from .packing import Rows

__all__ = ["cut_pieces", "cut_rows", "cut_squares", "split_rows"]


def _parts(row_tokens: list[int], target: int, most: list[int] | None = None) -> list[int]:
    """How many parts each row is cut into: always the row whose largest part is biggest, until
    there are ``target`` rows. Ties (full rows are many) go in a low-discrepancy order over the
    rows, so the cut rows are spread over the epoch rather than bunched at its start, where they
    would thin a mixture's share of this source for a while. ``most``: a row's most parts (its
    documents, when cuts fall only between them)."""
    count = len(row_tokens)
    spread = np.argsort((np.arange(count) * 0.6180339887498949) % 1.0, kind="stable")
    tie = np.empty(count, np.int64)
    tie[spread] = np.arange(count)
    parts = [1] * count
    heap = [(-t, int(tie[r]), r) for r, t in enumerate(row_tokens)]
    heapq.heapify(heap)
    extra = target - count
    while extra > 0:
        if not heap or -heap[0][0] <= 1:
            break  # every row down to one token (or none at all: no-split dropped them all)
        neg_part, order, r = heapq.heappop(heap)
        if most is not None and parts[r] >= most[r]:
            continue  # no boundary left to cut this row at: out of the heap for good
        parts[r] += 1
        extra -= 1
        # (-tokens) // parts == -ceil(tokens / parts): the row's new largest part, negated.
        heapq.heappush(heap, ((-row_tokens[r]) // parts[r], order, r))
    return parts


def split_rows(rows: Rows, target: int, *, whole_docs: bool = False) -> Rows:
    """``rows`` cut into ``target`` rows (>= rows.num_rows), each with at least one token — or as
    many as its tokens allow, fewer than ``target`` only when there are fewer tokens than that; a
    cut row's parts follow each other where the row was. Tokens and their order are unchanged.
    ``split_docs`` grows by the spans a cut falls inside. ``whole_docs``: cuts only between spans
    (fewer than ``target`` rows where the rows hold too few spans)."""
    if target <= rows.num_rows:
        return rows
    row_tokens = rows.row_tokens().tolist()
    per_row = np.diff(rows.row_offsets).tolist()
    offsets, pos, start, length = [0], [], [], []
    split_docs = rows.split_docs
    for r, p in enumerate(_parts(row_tokens, target, per_row if whole_docs else None)):
        lo, hi = int(rows.row_offsets[r]), int(rows.row_offsets[r + 1])
        spans = list(zip(rows.span_pos[lo:hi].tolist(), rows.span_start[lo:hi].tolist(), rows.span_len[lo:hi].tolist()))
        cuts = [row_tokens[r] * i // p for i in range(p + 1)]  # part i: row tokens [cuts[i], cuts[i + 1])
        if whole_docs and p > 1:
            cuts = _at_boundaries(cuts, np.cumsum([count for _, _, count in spans]).tolist())
        for a, b in zip(cuts[:-1], cuts[1:]):
            seen = 0
            for doc, first, count in spans:
                piece_lo, piece_hi = max(a, seen), min(b, seen + count)
                if piece_lo < piece_hi:
                    pos.append(doc)
                    start.append(first + piece_lo - seen)
                    length.append(piece_hi - piece_lo)
                seen += count
            offsets.append(len(pos))
        ends = np.cumsum([count for _, _, count in spans]).tolist()
        inside = [c for c in cuts[1:-1] if c not in set(ends)]  # cuts that fall within a span
        split_docs += len(set(np.searchsorted(ends, inside, side="right").tolist()))
    return Rows(
        rows.seq_len,
        *(np.asarray(v, dtype=np.int64) for v in (offsets, pos, start, length)),  # type: ignore[call-arg, arg-type]  # mypy cannot count a starred generator's fields
        rows.dropped,
        split_docs,
    )


def _at_boundaries(cuts: list[int], ends: list[int]) -> list[int]:
    """``cuts`` (0, the even inner cuts, the row's tokens) moved to the span ends ``ends`` nearest
    them, inner cuts distinct and increasing: each part holds whole spans, at least one."""
    inner = ends[:-1]  # the row's last end is its last cut already
    k = len(cuts) - 2  # inner cuts to place; a row is cut into at most len(ends) parts
    out, j = [0], 0
    for i, want in enumerate(cuts[1:-1]):
        # the nearest boundary from j on that leaves enough boundaries for the cuts after it
        last = len(inner) - (k - i)
        best = min(range(j, last + 1), key=lambda m: (abs(inner[m] - want), m))
        out.append(inner[best])
        j = best + 1
    return [*out, cuts[-1]]


def cut_rows(rows: Rows, seq_len: int) -> Rows:
    """``rows`` cut into rows of ``seq_len`` tokens (which divides ``rows.seq_len``): row r's
    tokens ``[j * seq_len, (j + 1) * seq_len)`` become a row, in order, and the spans a cut falls
    inside become two pieces (the second going on where the first stopped: its ``span_start``).
    Parts that would hold only padding are left out, so a batch of the result pads at its end.
    Tokens and their order are unchanged; ``split_docs`` grows by the spans cut."""
    if seq_len == rows.seq_len:
        return rows
    if seq_len < 1 or rows.seq_len % seq_len:
        raise ValueError(f"rows of {rows.seq_len} tokens cannot be cut into rows of {seq_len}")
    row_of, at = rows.span_places()
    first, last = at // seq_len, (at + rows.span_len - 1) // seq_len
    pieces = last - first + 1
    span = np.repeat(np.arange(pieces.size, dtype=np.int64), pieces)
    part = first[span] + np.arange(span.size, dtype=np.int64) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    lo = np.maximum(at[span], part * seq_len)
    hi = np.minimum(at[span] + rows.span_len[span], (part + 1) * seq_len)
    new_row = row_of[span] * (rows.seq_len // seq_len) + part  # non-decreasing: spans are in row order
    starts = np.flatnonzero(np.diff(new_row, prepend=-1)) if new_row.size else new_row
    offsets = np.append(starts, new_row.size).astype(np.int64)
    return Rows(
        seq_len,
        offsets,
        rows.span_pos[span],
        rows.span_start[span] + lo - at[span],
        hi - lo,
        rows.dropped,
        rows.split_docs + int((pieces > 1).sum()),
    )


def cut_pieces(rows: Rows, row_offsets: np.ndarray, seq_lens: np.ndarray) -> np.ndarray:
    """Per batch (rows ``row_offsets[b] .. row_offsets[b + 1] - 1``, cut to ``seq_lens[b]``):
    the pieces `cut_rows` makes of its spans; the metrics count them without cutting each batch."""
    batch, at, length, n = _cut_spans(rows, row_offsets, seq_lens)
    pieces = (at + length - 1) // n - at // n + 1
    return np.bincount(batch, weights=pieces, minlength=len(seq_lens)).astype(np.int64)


def cut_squares(rows: Rows, row_offsets: np.ndarray, seq_lens: np.ndarray) -> np.ndarray:
    """Per batch, as `cut_pieces`: the sum of the squared lengths of the pieces `cut_rows` makes
    (what a cut row's attention costs, `shardtool.plan.cost`), without cutting each batch."""
    batch, at, length, n = _cut_spans(rows, row_offsets, seq_lens)
    first, last = at // n, (at + length - 1) // n
    head = np.minimum(length, (first + 1) * n - at)  # the piece up to the first cut (all of it if none)
    tail = np.where(last > first, at + length - last * n, 0)
    middle = np.maximum(last - first - 1, 0)
    squares = head.astype(np.float64) ** 2 + tail.astype(np.float64) ** 2 + middle * n.astype(np.float64) ** 2
    return np.bincount(batch, weights=squares, minlength=len(seq_lens))


def _cut_spans(rows: Rows, row_offsets: np.ndarray, seq_lens) -> tuple[np.ndarray, ...]:
    """(batch, position in its row, length, the batch's seq_len) of every span in a batch."""
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    row_of, at = rows.span_places()
    batch_of = np.searchsorted(row_offsets, row_of, side="right") - 1
    inside = (batch_of >= 0) & (batch_of < seq_lens.size)  # rows of no batch count for none
    batch = batch_of[inside]
    return batch, at[inside], rows.span_len[inside].astype(np.int64), seq_lens[batch]
