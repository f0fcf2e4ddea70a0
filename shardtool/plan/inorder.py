"""How many batches a greedy in-order cut gives under a token budget, from the per-shard summaries.

Without bucketing (``shuffle=False``, or ``bucketing=False``) a group's samples are cut in their
order: a batch takes samples while their count times the longest so far fits ``max_tokens``.
Every rank must know every group's count to choose equal counts, from O(shards) summaries only.

The count is a sum over *segments* — runs of a few batches' worth of consecutive samples — of
samples × batches per sample of a greedy cut over samples drawn independently from the
segment's length distribution. That rate is exact for independent lengths (a Markov chain on the
length of the sample that opens each batch: it is the one that broke the previous batch, so
biased long; fresh openers under-count by ~9% on lognormal and real text). Segments keep what
dataset order does: a corpus sorted or clustered by length is narrow within a few batches, so
its batches are fuller than a shuffled one's. A segment's distribution comes from the shard's
length histogram (per octave: count, mean, spread) and, where the summaries have one, from the
weight sketch's cells (consecutive runs of a shard's samples with their exact token sums): each
cell is the shard's shape moved to the cell's mean and narrowed to the spread left within
cells. On small datasets the cells hold one or two samples each, so the order is seen almost
exactly; on large ones each shard is a small part of the corpus, and the shard is the locality.
"""

from __future__ import annotations

import numpy as np

from ..format.summaries import BINS, ShardSummaries, length_bins

__all__ = ["inorder_batches", "rate_from_histogram"]

# A segment spans at least this many batches (at the dataset's mean length): wide enough that
# the independent-lengths model holds inside it, narrow enough to follow a sorted corpus.
SEGMENT_BATCHES = 3
# At most this many segments in all (each costs a small chain), so planning stays O(shards).
MAX_SEGMENTS = 2048
_CHAIN_STEPS = 12


def _m_grid(budget: int) -> tuple[np.ndarray, np.ndarray]:
    """Batch sizes m = 1..budget: every m up to 32, then ranges growing 8% at a time, each
    evaluated at its middle and weighted by how many sizes it stands for."""
    exact = min(32, budget)
    edges = [exact + 1]
    while edges[-1] <= budget:
        edges.append(max(edges[-1] + 1, int(edges[-1] * 1.08)))
    e = np.asarray(edges, dtype=np.float64)
    e[-1] = budget + 1
    m = np.concatenate([np.arange(1, exact + 1, dtype=np.float64), (e[:-1] + e[1:] - 1) / 2])
    w = np.concatenate([np.ones(exact), np.diff(e)])
    return m, w


def _chain_rates(x: np.ndarray, p: np.ndarray, budget: int) -> np.ndarray:
    """Batches per sample of a greedy in-order cut over independent lengths, per row of
    (``x`` lengths, ``p`` probabilities) [R, K]: 1 / the mean batch size under the stationary law
    of the opening sample's length."""
    m, w = _m_grid(budget)
    cap = np.floor(budget / m)
    ok = x[:, :, None] <= cap[None, None, :]  # [R, K, M]: a sample of length x fits a batch of m
    cdf = (p[:, :, None] * ok).sum(axis=1)  # [R, M]: P(length <= budget / m)
    safe = np.where(cdf > 0, cdf, 1.0)
    power = np.where(cdf > 0, safe ** (m - 1)[None, :], 0.0)
    survive = ok * power[:, None, :]  # P(batch size >= m | opener x)
    mean_size = (survive * w).sum(axis=2)  # [R, K]
    # The next opener has density p(y) * (E[size | x] - sum_{m>=2} P(size>=m | x)/F(m) [y fits m]).
    later = np.where(m >= 2, w, 0.0)[None, :] / safe
    g = p.copy()
    for _ in range(_CHAIN_STEPS):
        u = (g[:, :, None] * survive).sum(axis=1) * later  # [R, M]
        h = (g * mean_size).sum(axis=1, keepdims=True) - (ok * u[:, None, :]).sum(axis=2)
        g = p * np.maximum(h, 0.0)
        g /= np.maximum(g.sum(axis=1, keepdims=True), 1e-300)
    size = (g * mean_size).sum(axis=1)
    return np.divide(1.0, size, out=np.zeros_like(size), where=size > 0)


def _two_points(count: np.ndarray, tokens: np.ndarray, squares: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row and histogram bin, two lengths at mean ± standard deviation (inside the bin),
    half the bin's count each: [R, 2 * BINS] lengths and probabilities."""
    mean = np.divide(tokens, count, out=np.zeros_like(tokens, dtype=np.float64), where=count > 0)
    second = np.divide(squares, count, out=np.zeros_like(squares, dtype=np.float64), where=count > 0)
    sd = np.sqrt(np.maximum(second - mean**2, 0.0))
    b = np.arange(BINS)
    lo = np.where(b == 0, 0.0, 2.0 ** (b - 1))[None, :]
    hi = np.where(b == 0, 0.0, 2.0**b - 1)[None, :]
    x = np.concatenate([np.clip(mean - sd, lo, hi), np.clip(mean + sd, lo, hi)], axis=1)
    half = np.concatenate([count, count], axis=1) / 2.0
    total = half.sum(axis=1, keepdims=True)
    return np.maximum(np.floor(x), 1.0), np.divide(half, total, out=np.zeros_like(half), where=total > 0)


def _rates(count: np.ndarray, tokens: np.ndarray, squares: np.ndarray, budget: int) -> np.ndarray:
    """Chain rates of histogram rows [R, BINS], keeping only the columns some row uses."""
    x, p = _two_points(count, tokens, squares)
    used = np.flatnonzero(p.sum(axis=0) > 0)
    x, p = x[:, used], p[:, used]
    out = np.zeros(count.shape[0])
    chunk = max(1, (1 << 21) // max(x.shape[1] * _m_grid(budget)[0].size, 1))
    for a in range(0, count.shape[0], chunk):
        out[a : a + chunk] = _chain_rates(x[a : a + chunk], p[a : a + chunk], budget)
    return out


def rate_from_histogram(count: np.ndarray, tokens: np.ndarray, squares: np.ndarray, budget: int) -> np.ndarray:
    """Batches per sample of an in-order cut of samples in random order, per histogram row [G, BINS]
    (a group shuffled without bucketing: its order is a random permutation)."""
    return _rates(np.atleast_2d(count), np.atleast_2d(tokens), np.atleast_2d(squares), budget)


def _atoms(summaries: ShardSummaries, cuts: np.ndarray) -> tuple[np.ndarray, ...]:
    """Consecutive runs of samples in dataset order, each within one shard and one group:
    (start, count, tokens, shard). A shard's sketch cells where it has them, else the shard;
    split at the group cuts (pro rata where a cut is not a cell boundary)."""
    offsets = np.concatenate([[0], np.cumsum(summaries.samples)]).astype(np.int64)
    tok_offsets = np.concatenate([[0], np.cumsum(summaries.tokens)]).astype(np.float64)
    if summaries.sketch is not None:
        inner_pos = summaries.sketch.pos + offsets[:-1, None]
        inner_tok = summaries.sketch.tokens + tok_offsets[:-1, None]
        pos = np.concatenate([offsets, inner_pos.ravel()])
        tok = np.concatenate([tok_offsets, inner_tok.ravel()])
    else:
        pos, tok = offsets, tok_offsets
    order = np.lexsort((tok, pos))
    pos, tok = pos[order], tok[order]
    keep = np.concatenate([np.diff(pos) > 0, [True]])  # one point per position (the last)
    pos, tok = pos[keep], tok[keep]
    # Group cuts inside a run: tokens before them pro rata within that run.
    extra = np.setdiff1d(np.asarray(cuts, dtype=np.int64), pos)
    if extra.size:
        j = np.searchsorted(pos, extra, side="right") - 1
        frac = (extra - pos[j]) / np.maximum(pos[j + 1] - pos[j], 1)
        pos = np.concatenate([pos, extra])
        tok = np.concatenate([tok, tok[j] + frac * (tok[j + 1] - tok[j])])
        order = np.argsort(pos, kind="stable")
        pos, tok = pos[order], tok[order]
    start, count, tokens = pos[:-1], np.diff(pos), np.diff(tok)
    shard = np.searchsorted(offsets, start, side="right") - 1
    return start, count, tokens, shard


def _shard_shape(summaries: ShardSummaries, start, count, tokens, shard) -> tuple[np.ndarray, ...]:
    """Per shard: its two-point lengths and probabilities [S, 2 * BINS], mean, variance; per atom
    the factor k in [0, 1] that narrows the shard's shape to the spread left within its runs."""
    x, p = _two_points(
        summaries.hist_count.astype(np.float64), summaries.hist_tokens.astype(np.float64), summaries.hist_squares
    )
    n = summaries.samples.astype(np.float64)
    mean = np.divide(summaries.tokens, n, out=np.zeros(n.size), where=n > 0)
    total_ss = np.maximum(summaries.hist_squares.sum(axis=1) - n * mean**2, 0.0)
    atom_mean = np.divide(tokens, count, out=np.zeros(count.size), where=count > 0)
    between = np.bincount(shard, weights=count * (atom_mean - mean[shard]) ** 2, minlength=n.size)
    several = np.bincount(shard, weights=np.where(count >= 2, count, 0), minlength=n.size)
    within = np.divide(np.maximum(total_ss - between, 0.0), several, out=np.zeros(n.size), where=several > 0)
    variance = np.divide(total_ss, n, out=np.zeros(n.size), where=n > 0)
    k = np.sqrt(np.clip(np.divide(within, variance, out=np.zeros(n.size), where=variance > 0), 0.0, 1.0))
    atom_k = np.where(count >= 2, k[shard], 0.0)
    return x, p, mean, atom_mean, atom_k


def inorder_batches(summaries: ShardSummaries, cuts: np.ndarray, budget: int) -> np.ndarray:
    """Estimated batches [G] of a greedy in-order cut of every group's range at ``budget`` tokens
    (padding counted), the groups' samples in dataset order."""
    cuts = np.asarray(cuts, dtype=np.int64)
    groups = cuts.size - 1
    samples = np.diff(cuts).astype(np.float64)
    if summaries.num_shards == 0 or not samples.sum():
        return np.zeros(groups)
    start, count, tokens, shard = _atoms(summaries, cuts)
    live = count > 0
    start, count, tokens, shard = start[live], count[live], tokens[live], shard[live]
    x, p, mean, atom_mean, atom_k = _shard_shape(summaries, start, count, tokens, shard)
    group = np.clip(np.searchsorted(cuts, start, side="right") - 1, 0, groups - 1)
    # Segments: runs of atoms of at least SEGMENT_BATCHES batches' worth of samples each.
    mean_length = max(float(summaries.tokens.sum()) / max(float(summaries.samples.sum()), 1.0), 1.0)
    span = max(SEGMENT_BATCHES * budget / mean_length, float(samples.sum()) / MAX_SEGMENTS, 1.0)
    before = start - cuts[group]
    seg_key = group * (int(samples.max() // span) + 2) + (before // span).astype(np.int64)
    _, segment = np.unique(seg_key, return_inverse=True)
    segments = int(segment.max()) + 1
    # Each atom: its shard's two-point shape, moved to its mean and narrowed by k; binned per segment.
    hist = np.zeros((3, segments * BINS))
    for a in range(0, count.size, 1 << 14):
        sl = slice(a, a + (1 << 14))
        s = shard[sl]
        y = atom_mean[sl, None] + (x[s] - mean[s, None]) * atom_k[sl, None]
        y = np.clip(y, 1.0, np.maximum(summaries.longest[s], 1)[:, None].astype(np.float64))
        wgt = count[sl, None] * p[s]
        cell = (segment[sl, None] * BINS + length_bins(y)).ravel()
        for i, v in enumerate((wgt, wgt * y, wgt * y * y)):
            hist[i] += np.bincount(cell, weights=v.ravel(), minlength=segments * BINS)
    c, t, q = (h.reshape(segments, BINS) for h in hist)
    rates = _rates(c, t, q, budget)
    seg_samples = np.bincount(segment, weights=count, minlength=segments)
    seg_group = np.zeros(segments, dtype=np.int64)
    seg_group[segment] = group
    out = np.bincount(seg_group, weights=seg_samples * rates, minlength=groups)
    # The last batch of a group is cut short: half a batch on average.
    return np.where(samples > 0, out + 0.5, 0.0)
