"""How many batches a token budget makes of a length histogram: the expected batches per sample
of each octave bin, where a batch holds floor(budget / L) samples of its opener's length L."""

from __future__ import annotations

import numpy as np

__all__ = ["bin_support", "inverse_capacity"]


def bin_support(bins: int, points: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """Per histogram bin, ``points`` lengths spanning it ([2^(b-1), 2^b)), and their weights (how
    many integers each stands for). Bin 0 is length 0."""
    grid = np.zeros((bins, points))
    span = np.zeros((bins, points))
    for b in range(bins):
        if b == 0:
            grid[b, 0], span[b, 0] = 0, 1
            continue
        lo, hi = 1 << (b - 1), 1 << b
        values = np.arange(lo, hi) if hi - lo <= points else np.linspace(lo, hi, points, endpoint=False)
        grid[b, : len(values)] = np.floor(values)
        span[b, : len(values)] = (hi - lo) / len(values)
    return grid, span


def inverse_capacity(
    mean: np.ndarray, variance: np.ndarray, share: np.ndarray, window: float, budget: int
) -> np.ndarray:
    """Per bin, the expected batches per sample: 1 / floor(budget / L_open) over its lengths.

    Within a bin (an octave) lengths follow an exponential tilt whose mean is the bin's mean (the
    fit is a bisection on the tilt); the floor makes 1/capacity a step function of L, so its
    average over the bin is not its value at the mean. A batch's capacity is set by its first,
    longest sample: where lengths are sparse (the long tail) the cap(L) samples of a batch span
    cap(L) / density lengths, so the opener is about half that longer than an average member.
    A bin narrower than the tilt of its mean (lengths all alike: a pre-chunked corpus whose
    samples are all 3,000 tokens) is that many parts a point at its mean, matching its variance.
    ``share`` is each bin's share of the samples, ``window`` the samples sorted together.
    """
    bins = mean.shape[0]
    grid, span = bin_support(bins)
    present = span > 0
    lo = np.where(present, grid, np.inf).min(axis=1)
    hi = np.where(present, grid, -np.inf).max(axis=1)
    width = np.maximum(hi - lo, 1)
    x = (grid - lo[:, None]) / width[:, None]
    target = np.clip(mean, lo, hi)
    tilt_lo, tilt_hi = np.full(bins, -60.0), np.full(bins, 60.0)

    def weights(tilt):
        w = span * np.exp(tilt[:, None] * (x - 0.5))
        return np.where(present, w, 0.0)

    for _ in range(60):
        mid = (tilt_lo + tilt_hi) / 2
        w = weights(mid)
        got = (w * grid).sum(axis=1) / w.sum(axis=1)
        tilt_lo = np.where(got < target, mid, tilt_lo)
        tilt_hi = np.where(got < target, tilt_hi, mid)
    w = weights((tilt_lo + tilt_hi) / 2)
    norm = w.sum(axis=1, keepdims=True)
    capacity = np.maximum(budget // np.maximum(grid, 1), 1)
    # samples per integer length, in one window
    density = np.divide(window * share[:, None] * w / norm, span, out=np.zeros_like(w), where=span > 0)
    opener = grid + 0.5 * np.divide(capacity, density, out=np.zeros_like(w), where=density > 0)
    spread = (w * (1.0 / np.maximum(budget // np.maximum(np.floor(opener), 1), 1))).sum(axis=1) / norm[:, 0]
    tilt_mean = (w * grid).sum(axis=1) / norm[:, 0]
    tilt_variance = (w * (grid - tilt_mean[:, None]) ** 2).sum(axis=1) / norm[:, 0]
    point = np.clip(
        1.0 - np.divide(variance, tilt_variance, out=np.ones_like(variance), where=tilt_variance > 0), 0.0, 1.0
    )
    at_mean = 1.0 / np.maximum(budget // np.maximum(np.round(mean), 1), 1)
    return point * at_mean + (1.0 - point) * spread
