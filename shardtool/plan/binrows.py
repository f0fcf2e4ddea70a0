"""Packed rows from a length histogram: what `rows_estimate` is told by a group's (or a sample's)
power-of-two bins of document counts and tokens (`shardtool.format.summaries`), a bin straddling
a limit counted pro rata. One function for both, so that no-split's correction (the rows best fit
packs a sample into, over this estimate of the same sample) corrects exactly the estimate the
plan makes of a group."""

from __future__ import annotations

import numpy as np

from ..format.summaries import BINS, length_bins
from .packing import Packing, rows_estimate

__all__ = ["BIN_HIGH", "BIN_LOW", "histogram_of", "histogram_rows", "longer_than", "over_a_row"]

# Bin b holds lengths [BIN_LOW[b], BIN_HIGH[b]): 0 alone, then [2^(b-1), 2^b).
BIN_LOW = np.array([0] + [1 << (b - 1) for b in range(1, BINS)], dtype=np.float64)
BIN_HIGH = np.array([1] + [1 << b for b in range(1, BINS)], dtype=np.float64)


def longer_than(limit: float) -> np.ndarray:
    """Per histogram bin, the share of its documents longer than ``limit`` tokens (pro rata)."""
    return np.clip((BIN_HIGH - 1 - limit) / np.maximum(BIN_HIGH - BIN_LOW, 1), 0.0, 1.0)


def over_a_row(packing: Packing) -> np.ndarray:
    """Per histogram bin, the share of its documents longer than a row (pro rata where the row's
    length falls inside the bin): what no-split leaves out."""
    return longer_than(packing.seq_len - packing.extra_tokens)  # the longest length that fits a row


def histogram_of(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(documents, tokens) per bin of ``lengths``, as a shard's summaries count them."""
    bins = length_bins(np.asarray(lengths, dtype=np.int64))
    count = np.bincount(bins, minlength=BINS).astype(np.float64)
    tokens = np.bincount(bins, weights=np.asarray(lengths, dtype=np.float64), minlength=BINS)
    return count, tokens


def histogram_rows(count: np.ndarray, tokens: np.ndarray, samples: int, windows: int, packing: Packing) -> float:
    """Rows `rows_estimate` expects for documents of this histogram (``count`` and ``tokens`` per
    bin; ``samples`` documents in all) packed in ``windows`` windows. For no-split, the documents
    longer than a row are left out, and those over half a row take a row each."""
    too_long = half = None
    if packing.policy == "no-split":
        over = over_a_row(packing)
        docs = int(round(float((count * over).sum())))
        long_tokens = int(round(float((tokens * over).sum())))
        too_long = (min(docs, int(samples)), min(long_tokens, int(round(float(tokens.sum())))))
        half = float((count * (longer_than(packing.seq_len / 2 - packing.extra_tokens) - over)).sum())
    # Documents whose piece, not their tokens, fills a row's share (length + eos < seq / max_docs).
    piece_limit = packing.seq_len / packing.max_docs_per_row - packing.extra_tokens
    below = np.clip((piece_limit - BIN_LOW) / np.maximum(BIN_HIGH - BIN_LOW, 1), 0.0, 1.0)
    short = (float((count * below).sum()), float((tokens * below).sum()))
    return rows_estimate(
        int(round(float(tokens.sum()))),
        int(samples),
        packing,
        windows=max(int(windows), 1),
        too_long=too_long,
        short=short,
        half=half,
    )
