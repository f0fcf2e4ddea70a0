"""The one lengths generator for synthetic corpora: tests, benchmarks, `shardtool plan --synthetic`
and `shardtool bench --generate` all draw lengths here, so "the lognormal corpus" means one thing.

Text lengths in tokens are close to lognormal; the default (median 350, sigma 0.8, clipped to
1..8192) is the corpus the README's benchmark tables were measured on.
"""
from __future__ import annotations

import numpy as np

__all__ = ["MEDIAN", "SIGMA", "MAX_LENGTH", "lognormal_lengths"]

MEDIAN = 350.0
SIGMA = 0.8
MAX_LENGTH = 8192


def lognormal_lengths(n: int, *, seed: int | np.random.Generator = 0, median: float = MEDIAN,
                      sigma: float = SIGMA, low: int = 1, high: int = MAX_LENGTH) -> np.ndarray:
    """``n`` int64 lengths, lognormal around ``median``, clipped to ``[low, high]``; deterministic
    from ``seed`` (an int, hashed by numpy's SeedSequence, or a Generator to draw from)."""
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    values = rng.lognormal(np.log(median), sigma, int(n))
    return np.clip(np.round(values), low, high).astype(np.int64)
