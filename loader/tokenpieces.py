"""Where a batch's tokens lie in memory, typed: what shard views report and what the readers of
padded and packed batches copy from.

A view (`ShardView.token_pieces`) reports `TokenPiece`s: for some rows of the batch, the raw
buffers (a shard's map, or a compressed shard's decompressed record batches) and each sample's
first element and element count in its buffer. `join_pieces` joins a batch's pieces across shards
into one `TokenPieces`, so the per-batch numpy work does not grow with the shards a batch spans;
`TokenSources` is that by sample id, for callers that lay tokens out themselves (packed rows).
`pad_tokens` copies one batch of pieces into a padded [B, width] array.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import numpy as np

from .collate import Alloc
from .scratch import Scratch

__all__ = ["TokenPiece", "TokenPieces", "TokenSources", "join_pieces", "pad_tokens"]


class TokenPiece(NamedTuple):
    """Rows ``rows`` of a batch: row ``rows[k]``'s tokens are elements ``first[k] : first[k] +
    counts[k]`` of ``buffers[which[k]]`` (raw bytes of the stored dtype). (``counts``, not
    ``count``: a tuple's ``count`` method would be shadowed.)"""

    rows: np.ndarray
    first: np.ndarray
    counts: np.ndarray
    which: np.ndarray
    buffers: list[Any]


class TokenPieces(NamedTuple):
    """A batch's pieces joined: ``which`` indexes the one ``buffers`` list."""

    rows: np.ndarray
    which: np.ndarray
    first: np.ndarray
    counts: np.ndarray
    buffers: list[Any]


class TokenSources(NamedTuple):
    """`TokenPieces` by position in the ids asked for (sample k's tokens: elements ``first[k] :
    first[k] + counts[k]`` of ``dtype`` in ``buffers[which[k]]``), with their keys (empty where
    none were asked for)."""

    keys: list[Any]
    buffers: list[Any]
    which: np.ndarray
    first: np.ndarray
    counts: np.ndarray
    dtype: np.dtype


def join_pieces(per_view: Iterable[list[TokenPiece]]) -> TokenPieces:
    """One `TokenPieces` of every view's pieces, buffer indices shifted to the joined list."""
    rows_l: list[np.ndarray] = []
    first_l: list[np.ndarray] = []
    n_l: list[np.ndarray] = []
    which_l: list[np.ndarray] = []
    bufs: list[Any] = []
    for pieces in per_view:
        for p in pieces:
            rows_l.append(p.rows)
            first_l.append(p.first)
            n_l.append(p.counts)
            which_l.append(p.which + len(bufs))
            bufs.extend(p.buffers)

    def joined(parts: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    return TokenPieces(joined(rows_l), joined(which_l), joined(first_l), joined(n_l), bufs)


def pad_tokens(
    pieces: TokenPieces, b: int, dtype: np.dtype, pad_id: int, alloc: Alloc, scratch: Scratch
) -> tuple[np.ndarray, np.ndarray]:
    """(int64 [b, width] tokens padded with ``pad_id``, int64 [b] counts) of ``pieces``."""
    rows, which, first, n, bufs = pieces
    counts = alloc(b, np.int64)
    counts[rows] = n
    width = int(counts.max(initial=0))
    padded = alloc((b, width), np.int64)
    info = np.iinfo(dtype)
    if not info.min <= pad_id <= info.max:
        padded.fill(pad_id)
        views = [np.frombuffer(buf, dtype=dtype, count=len(buf) // dtype.itemsize) for buf in bufs]
        for r, w, a, c in zip(rows.tolist(), which.tolist(), first.tolist(), n.tolist()):
            padded[r, :c] = views[w][a : a + c]  # pad id outside the stored dtype: widen per row
        return padded, counts
    # Rows are copied as raw bytes (memoryview slice assignment is a bare memcpy, several
    # times cheaper per sample than a numpy slice assignment with a cast), in the stored
    # dtype; one vectorised cast then widens the whole batch. An index-array gather would
    # cost more than the tokens themselves.
    narrow = padded if dtype == padded.dtype else scratch.array((b, width), dtype)
    narrow.fill(pad_id)
    # .data is memoryview(narrow...): numpy's stubs give ndarray __buffer__ only from Python 3.12
    dst = narrow.reshape(-1).view(np.uint8).data
    item = dtype.itemsize
    for r, w, a, k in zip(
        (rows * (width * item)).tolist(), which.tolist(), (first * item).tolist(), (n * item).tolist()
    ):
        dst[r : r + k] = bufs[w][a : a + k]
    dst.release()
    if narrow is not padded:
        np.copyto(padded, narrow)
    return padded, counts
