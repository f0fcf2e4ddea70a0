"""One window's documents into rows of ``seq_len`` tokens: the policy's dispatch and ``concat``.

``best-fit`` and ``no-split`` are best-fit decreasing (`bestfit`); ``concat`` (and ``stream``,
the same cut of documents in storage order) lays the documents end to end and cuts every
``seq_len`` tokens (here). Both build the `Rows` of `config`.
"""

from __future__ import annotations

import numpy as np

from .bestfit import best_fit
from .config import Packing, Rows

__all__ = ["merge_rows", "pack_rows", "pack_windows"]


def pack_rows(lengths: np.ndarray, packing: Packing) -> Rows:
    """Pack one window's documents (``lengths`` in window order, as stored: the eos, if any, is
    added here) into rows of ``packing.seq_len`` tokens. Deterministic: ties broken by position."""
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or (lengths.size and lengths.dtype.kind not in "iu"):
        raise ValueError(f"lengths must be a 1-D integer array, found {lengths.dtype} of shape {lengths.shape}")
    lengths = lengths.astype(np.int64, copy=False)
    if lengths.size and lengths.min() < 0:
        bad = int(np.flatnonzero(lengths < 0)[0])
        raise ValueError(f"lengths must be >= 0: document at window position {bad} has length {int(lengths[bad])}")
    sizes = lengths + packing.extra_tokens
    if packing.policy in ("concat", "stream"):  # stream: the caller gives the documents as stored
        return _concat(sizes, packing)
    return best_fit(sizes, packing, drop_long=packing.policy == "no-split")


def pack_windows(lengths: np.ndarray, ids: np.ndarray, packing: Packing, window: int) -> Rows:
    """A group's documents (``lengths`` of ``ids``, in the group's order) packed window by window:
    equal windows of about ``window`` documents (``stream``: one, the stored token stream), so
    that a group's last window is not a small leftover. Rows hold global ids (``with_ids``)."""
    count = ids.size
    windows = (1 if packing.policy == "stream" else -(-count // window)) if count else 0
    cuts = (np.arange(windows + 1, dtype=np.int64) * count) // max(windows, 1)
    return Rows.concat(
        [pack_rows(lengths[a:b], packing).with_ids(ids[a:b]) for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist())],
        packing.seq_len,
    )


def merge_rows(rows: Rows, packing: Packing) -> Rows:
    """The tokens of ``rows`` in as few rows as ``concat`` cuts them into: the spans sorted by
    document and offset, a document's adjacent pieces joined, laid end to end and cut every
    ``seq_len`` tokens (or at ``max_docs_per_row`` pieces). The rows of equal counts use it to
    absorb a surplus of rows when every token must be served. ``split_docs`` is recounted.
    ``no-split`` packing never cuts a document (an image's placeholders with it): its joined
    pieces are packed whole, best-fit decreasing, which may take a row or two more."""
    order = np.lexsort((rows.span_start, rows.span_pos))
    pos, start, size = rows.span_pos[order], rows.span_start[order], rows.span_len[order]
    joins = np.ones(len(pos), dtype=bool)  # a piece that does not continue the one before it
    joins[1:] = (pos[1:] != pos[:-1]) | (start[1:] != start[:-1] + size[:-1])
    first = np.flatnonzero(joins)
    sizes = np.add.reduceat(size, first) if first.size else np.zeros(0, np.int64)
    if packing.policy == "no-split":
        cut = best_fit(sizes.astype(np.int64), packing, drop_long=False)
    else:
        cut = _concat(sizes.astype(np.int64), packing)
    return Rows(
        rows.seq_len,
        cut.row_offsets,
        pos[first][cut.span_pos],
        start[first][cut.span_pos] + cut.span_start,
        cut.span_len,
        rows.dropped,
        cut.split_docs,
    )


def _concat(sizes: np.ndarray, packing: Packing) -> Rows:
    seq, maxd = packing.seq_len, packing.max_docs_per_row
    pos = np.flatnonzero(sizes > 0)
    cum = np.zeros(len(pos) + 1, np.int64)
    np.cumsum(sizes[pos], out=cum[1:])
    total = int(cum[-1])
    row_starts = np.arange(0, total, seq, dtype=np.int64)
    # A row [a, a + seq) holds pieces of the documents it overlaps; with short documents that can
    # exceed the bound, and then rows are cut one by one (rare: only ~seq/32-token documents).
    first_doc = np.searchsorted(cum, row_starts, side="right") - 1
    last_doc = np.searchsorted(cum, np.minimum(row_starts + seq, total), side="left") - 1
    if row_starts.size and int((last_doc - first_doc).max()) + 1 > maxd:
        row_starts = _bounded_row_starts(cum, seq, maxd)
    breaks = np.union1d(cum[:-1], row_starts)  # piece starts: a document's or a row's start
    piece_end = np.append(breaks[1:], total)
    doc = np.searchsorted(cum, breaks, side="right") - 1
    row = np.searchsorted(row_starts, breaks, side="right") - 1
    offsets = np.searchsorted(row, np.arange(len(row_starts) + 1), side="left").astype(np.int64)
    start = breaks - cum[doc]
    split = int(np.count_nonzero((start[1:] > 0) & (start[:-1] == 0)))
    return Rows(seq, offsets, pos[doc], start, piece_end - breaks, np.zeros(0, np.int64), split)


def _bounded_row_starts(cum: np.ndarray, seq: int, maxd: int) -> np.ndarray:
    """Row starts when a row ends at ``seq`` tokens or after ``maxd`` pieces, whichever is first."""
    total, n = int(cum[-1]), len(cum) - 1
    starts, p = [], 0
    search = np.searchsorted
    while p < total:
        starts.append(p)
        d = int(search(cum, p, side="right")) - 1
        p = min(p + seq, int(cum[min(d + maxd, n)]))
    return np.asarray(starts, dtype=np.int64)
