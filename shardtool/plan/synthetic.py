"""The one lengths generator for synthetic corpora: tests, benchmarks, `shardtool plan --synthetic`
and `shardtool bench --generate` all draw lengths here, so "the lognormal corpus" means one thing.

Text lengths in tokens are close to lognormal; the default (median 350, sigma 0.8, clipped to
1..8192) is the corpus docs/benchmarks.md's tables were measured on. Draws go through a table
of 65,536 lognormal quantiles (a uint16 per sample, then a lookup), several times cheaper than
exp(normal): `SyntheticSource` makes up a billion lengths, shard by shard, in seconds.
"""

from __future__ import annotations

import functools
from statistics import NormalDist
from typing import Any

import numpy as np

from ..format.sketch import sketch_cells
from ..format.summaries import ShardSummaries
from .forked import forked_map

__all__ = ["MAX_LENGTH", "MEDIAN", "SIGMA", "SyntheticSource", "lognormal_lengths"]

MEDIAN = 350.0
SIGMA = 0.8
MAX_LENGTH = 8192
_LEVELS = 1 << 16


@functools.lru_cache(maxsize=16)
def _quantiles(median: float, sigma: float, low: int, high: int) -> np.ndarray:
    inv = NormalDist().inv_cdf
    z = np.array([inv((i + 0.5) / _LEVELS) for i in range(_LEVELS)])
    return np.clip(np.round(median * np.exp(sigma * z)), low, high).astype(np.int64)


def lognormal_lengths(
    n: int,
    *,
    seed: int | np.random.Generator = 0,
    median: float = MEDIAN,
    sigma: float = SIGMA,
    low: int = 1,
    high: int = MAX_LENGTH,
) -> np.ndarray:
    """``n`` int64 lengths, lognormal around ``median``, clipped to ``[low, high]``; deterministic
    from ``seed`` (an int, hashed by numpy's SeedSequence, or a Generator to draw from)."""
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    return _quantiles(float(median), float(sigma), int(low), int(high))[
        rng.integers(0, _LEVELS, int(n), dtype=np.uint16)
    ]


class SyntheticSource:
    """A plan source of ``n`` made-up lengths in shards of ``samples_per_shard``, each shard's
    lengths drawn from its own seed, so any range is made on demand and nothing holds all ``n``."""

    CHUNK = 256  # shards whose summaries are computed in one vectorised pass

    def __init__(
        self,
        n: int,
        *,
        samples_per_shard: int = 10_000,
        seed: int = 0,
        median: float = MEDIAN,
        sigma: float = SIGMA,
        high: int = MAX_LENGTH,
        processes: int = 1,
    ):
        self.n = int(n)
        self.per_shard = int(samples_per_shard)
        self.seed = seed
        self.params: dict[str, Any] = dict(median=median, sigma=sigma, high=high)
        full, rest = divmod(self.n, self.per_shard)
        counts = np.full(full + (1 if rest else 0), self.per_shard, dtype=np.int64)
        if rest:
            counts[-1] = rest
        self.shard_counts = counts
        self.offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.processes = processes
        self._summaries: ShardSummaries | None = None

    def shard_lengths(self, shard: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, shard])
        return lognormal_lengths(int(self.shard_counts[shard]), seed=rng, **self.params)

    def _chunk(self, first: int) -> ShardSummaries:
        last = min(first + self.CHUNK, len(self.shard_counts))
        lengths = np.concatenate([self.shard_lengths(s) for s in range(first, last)])
        return ShardSummaries.from_lengths(lengths, self.shard_counts[first:last], sketch_cells(len(self.shard_counts)))

    def use_summaries(self, summaries: ShardSummaries) -> None:
        """Take ``summaries`` computed earlier (as a training rank reads them from the dataset)
        instead of computing them: a fresh process that times planning alone."""
        self._summaries = summaries

    @property
    def summaries(self) -> ShardSummaries:
        """What a dataset would store; computed once (the only pass over all ``n`` lengths)."""
        if self._summaries is None:
            firsts = list(range(0, len(self.shard_counts), self.CHUNK))
            parts = forked_map(SyntheticSource._chunk, self, firsts, self.processes)
            self._summaries = (
                ShardSummaries.concat(parts)
                if parts
                else ShardSummaries.from_lengths(
                    np.zeros(0, np.int64), self.shard_counts, sketch_cells(len(self.shard_counts))
                )
            )
        return self._summaries

    def lengths_range(self, lo: int, hi: int) -> np.ndarray:
        first = int(np.searchsorted(self.offsets, lo, side="right")) - 1
        parts = []
        shard = max(first, 0)
        while shard < len(self.shard_counts) and self.offsets[shard] < hi:
            begin = int(self.offsets[shard])
            lengths = self.shard_lengths(shard)
            parts.append(lengths[max(lo - begin, 0) : hi - begin])
            shard += 1
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)
