"""Hypothesis strategies shared by the planning and state tests.

Datasets are drawn as (seed, size, shape of the length distribution, shard
scheme) and generated with numpy, which keeps examples fast; hypothesis still
shrinks the size and the parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from shardtool.plan import Batching
from shardtool.plan.synthetic import lognormal_lengths
from shardtool.plan import Layout

# Every (nodes, ranks per node) with a world of 1..8 ranks.
LAYOUTS = [Layout(n, g) for n in range(1, 9) for g in range(1, 9) if n * g <= 8]


@dataclass(frozen=True)
class Dataset:
    lengths: np.ndarray
    shard_counts: np.ndarray



def make_lengths(rng: np.random.Generator, size: int, shape: str) -> np.ndarray:
    if shape == "lognormal":
        return lognormal_lengths(size, seed=rng, median=60, sigma=1.0, low=0, high=2000)
    elif shape == "skewed":
        # Mostly short with a heavy tail of long samples.
        values = np.where(rng.random(size) < 0.9, rng.integers(1, 20, size), rng.integers(200, 2000, size))
    elif shape == "zeros":
        values = np.where(rng.random(size) < 0.3, 0, rng.lognormal(np.log(40), 0.8, size))
    else:
        values = np.full(size, 50)
    return np.clip(values, 0, 2000).astype(np.int64)


def make_shard_counts(rng: np.random.Generator, size: int, shards: int, allow_empty: bool) -> np.ndarray:
    shards = max(1, min(shards, size))
    cuts = np.sort(rng.choice(np.arange(1, size), size=shards - 1, replace=False)) if shards > 1 else []
    counts = np.diff(np.concatenate([[0], cuts, [size]])).astype(np.int64)
    if allow_empty:
        counts = np.insert(counts, rng.integers(0, counts.size + 1), 0)
    return counts


@st.composite
def datasets(draw, min_size: int = 1, max_size: int = 3000) -> Dataset:
    seed = draw(st.integers(0, 2**32 - 1))
    size = draw(st.integers(min_size, max_size))
    shape = draw(st.sampled_from(["lognormal", "skewed", "zeros", "constant"]))
    shards = draw(st.sampled_from([1, 3, 14, 50, 200]))
    allow_empty = draw(st.booleans())
    rng = np.random.default_rng(seed)
    return Dataset(make_lengths(rng, size, shape), make_shard_counts(rng, size, shards, allow_empty))


layouts = st.sampled_from(LAYOUTS)


@st.composite
def batchings(draw, lengths: np.ndarray, mode: str | None = None, any_window: bool = True) -> Batching:
    """A config valid for `lengths`; any_window=False keeps the default window."""
    mode = mode or draw(st.sampled_from(["batch_size", "max_tokens"]))
    shuffle = draw(st.booleans())
    seed = draw(st.integers(0, 2**31))
    window = draw(st.one_of(st.none(), st.integers(1, 400))) if any_window else None
    if mode == "batch_size":
        return Batching(batch_size=draw(st.integers(1, 16)), shuffle=shuffle, seed=seed, window=window)
    longest = max(int(lengths.max(initial=0)), 1)
    budget = draw(st.integers(longest, 8 * longest))
    return Batching(max_tokens=budget, shuffle=shuffle, seed=seed, window=window)


@dataclass(frozen=True)
class Case:
    data: Dataset
    layout: Layout
    batching: Batching
    epoch: int


@st.composite
def cases(draw, mode: str | None = None, min_size: int = 400, any_window: bool = True) -> Case:
    """A dataset large enough for every layout here to get batches."""
    data = draw(datasets(min_size=min_size))
    batching = draw(batchings(data.lengths, mode, any_window))
    return Case(data, draw(layouts), batching, draw(st.integers(0, 1000)))
