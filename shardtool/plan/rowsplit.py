"""Split packed rows into more, shorter rows: the packed twin of splitting a deficit group's batches.

A group whose windows packed fewer rows than it owes batches (few tokens, one row a batch, many DP
ranks) must still hand every batch at least one real token, without dropping any: its fullest rows
are cut into near-equal parts, at token positions (a cut may fall inside a document, as ``concat``
cuts documents anyway). Rare, and small when it happens, so plain Python is fine.
"""

from __future__ import annotations

import heapq

import numpy as np

from .packing import Rows

__all__ = ["split_rows"]


def _parts(row_tokens: list[int], target: int) -> list[int]:
    """How many parts each row is cut into: always the row whose largest part is biggest, until
    there are ``target`` rows. Ties (full rows are many) go in a low-discrepancy order over the
    rows, so the cut rows are spread over the epoch rather than bunched at its start, where they
    would thin a mixture's share of this source for a while."""
    count = len(row_tokens)
    spread = np.argsort((np.arange(count) * 0.6180339887498949) % 1.0, kind="stable")
    tie = np.empty(count, np.int64)
    tie[spread] = np.arange(count)
    parts = [1] * count
    heap = [(-t, int(tie[r]), r) for r, t in enumerate(row_tokens)]
    heapq.heapify(heap)
    for _ in range(target - count):
        if not heap or -heap[0][0] <= 1:
            break  # every row down to one token (or none at all: no-split dropped them all)
        neg_part, order, r = heapq.heappop(heap)
        parts[r] += 1
        # (-tokens) // parts == -ceil(tokens / parts): the row's new largest part, negated.
        heapq.heappush(heap, ((-row_tokens[r]) // parts[r], order, r))
    return parts


def split_rows(rows: Rows, target: int) -> Rows:
    """``rows`` cut into ``target`` rows (>= rows.num_rows), each with at least one token — or as
    many as its tokens allow, fewer than ``target`` only when there are fewer tokens than that; a
    cut row's parts follow each other where the row was. Tokens and their order are unchanged.
    ``split_docs`` grows by the spans a cut falls inside."""
    if target <= rows.num_rows:
        return rows
    row_tokens = rows.row_tokens().tolist()
    offsets, pos, start, length = [0], [], [], []
    split_docs = rows.split_docs
    for r, p in enumerate(_parts(row_tokens, target)):
        lo, hi = int(rows.row_offsets[r]), int(rows.row_offsets[r + 1])
        spans = list(zip(rows.span_pos[lo:hi].tolist(), rows.span_start[lo:hi].tolist(), rows.span_len[lo:hi].tolist()))
        cuts = [row_tokens[r] * i // p for i in range(p + 1)]  # part i: row tokens [cuts[i], cuts[i + 1])
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
