"""Hypothesis strategies shared by the planning and state tests.

Datasets are drawn as (seed, size, shape of the length distribution, shard
scheme) and generated with numpy, which keeps examples fast; hypothesis still
shrinks the size and the parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from shardtool.plan import Batching, Layout
from shardtool.plan.cost import CostModel
from shardtool.plan.synthetic import lognormal_lengths

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


# Cost models the strategies draw: attention-heavy (squares dominate) and linear only.
COST_MODELS = [CostModel(1.0, 0.05), CostModel(0.0, 1.0), CostModel(1.0, 0.0)]


@st.composite
def batchings(draw, lengths: np.ndarray, mode: str | None = None, any_window: bool = True) -> Batching:
    """A config valid for `lengths`; any_window=False keeps the default window."""
    mode = mode or draw(st.sampled_from(["batch_size", "max_tokens"]))
    shuffle = draw(st.booleans())
    seed = draw(st.integers(0, 2**31))
    window = draw(st.one_of(st.none(), st.integers(1, 400))) if any_window else None
    # Compute-balanced steps (issue 33) reorder the deal: every plan invariant must still hold.
    balance = draw(st.one_of(st.none(), st.sampled_from(COST_MODELS)))
    balanced = {
        "balance": balance,
        "balance_window": draw(st.one_of(st.none(), st.integers(1, 40))) if balance else None,
        "micro_batches": draw(st.one_of(st.none(), st.integers(1, 4))) if balance else None,
    }
    # Block-wise shuffles (shuffle_block, issue 32) cut each block's batches: likewise. A block
    # cuts windows too (one of 1 sample is a batch a sample), so any_window=False draws none: its
    # tests bound what the default window leaves out.
    balanced["shuffle_block"] = draw(st.one_of(st.none(), st.integers(1, 600))) if shuffle and any_window else None
    if mode == "batch_size":
        return Batching(batch_size=draw(st.integers(1, 16)), shuffle=shuffle, seed=seed, window=window, **balanced)
    longest = max(int(lengths.max(initial=0)), 1)
    budget = draw(st.integers(longest, 8 * longest))
    return Batching(max_tokens=budget, shuffle=shuffle, seed=seed, window=window, **balanced)


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


# ---------------------------------------------------------------------- mixtures
MIXTURE_LAYOUTS = [Layout(1, 1), Layout(2, 1), Layout(1, 2), Layout(2, 2)]


@dataclass(frozen=True)
class MixtureCase:
    sizes: tuple[int, ...]
    weights: tuple[float, ...]
    layout: Layout
    batching: Batching
    seed: int
    corpus: bool = False  # the benchmarks' text-like lengths (median 350, up to 8192), else short ones

    def sources(self):
        """{name: ArraySource} of lognormal lengths: median 60 up to 700 tokens, or the corpus's."""
        from shardtool.plan import ArraySource

        rng = np.random.default_rng(self.seed)
        out = {}
        for i, size in enumerate(self.sizes):
            lengths = (
                lognormal_lengths(size, seed=rng)
                if self.corpus
                else lognormal_lengths(size, seed=rng, median=60, high=700)
            )
            out[f"s{i}"] = ArraySource(lengths, make_shard_counts(rng, size, 8, False))
        return out


@st.composite
def mixture_cases(
    draw,
    packed: bool,
    min_size: int = 300,
    max_size: int = 1500,
    max_sources: int = 4,
    corpus: bool = False,
    balanced: bool = False,
) -> MixtureCase:
    """Small sources of short lengths (rows of 128-512 tokens, batches of 1024-4096), or with
    ``corpus`` text-like sources of 10,000-40,000 samples (rows of 1024-4096 tokens, at least 4 a
    step; batches of 8192-32768 tokens), the scale where the shares are measured. ``balanced``:
    steps balanced by a cost model with attention dominant (blocks of a drawn window, or the whole epoch)."""
    from shardtool.plan.cost import CostModel
    from shardtool.plan.packing import Packing

    k = draw(st.integers(1, max_sources))
    if corpus:
        min_size, max_size = 10000, 40000
    sizes = tuple(draw(st.integers(min_size, max_size)) for _ in range(k))
    weights = tuple(draw(st.integers(2, 100)) / 100 for _ in range(k))
    seed = draw(st.integers(0, 2**31))
    if packed:
        rows = draw(st.integers(4, 8)) if corpus else draw(st.integers(2, 8))
        seq = draw(st.sampled_from([1024, 2048, 4096] if corpus else [128, 256, 512]))
        batching = Batching(
            batch_size=rows, seed=seed, packing=Packing(seq, draw(st.sampled_from(["best-fit", "concat", "stream"])))
        )
    else:
        budget = draw(st.sampled_from([8192, 16384, 32768] if corpus else [1024, 2048, 4096]))
        batching = Batching(max_tokens=budget, seed=seed)
    if balanced:
        batching = batching.with_balance(CostModel(1.0, 0.05), draw(st.sampled_from([None, 1, 7])))
    return MixtureCase(sizes, weights, draw(st.sampled_from(MIXTURE_LAYOUTS)), batching, seed, corpus)


# ------------------------------------------------------------------ WebDataset tars as other tools write them
@st.composite
def tar_samples(draw):
    """(tar format, samples): keys with or without a directory and of any length (long names need
    PAX or GNU headers), a fixed field set, payloads of 0..3000 bytes (some on block boundaries)."""
    import tarfile

    fmt = draw(st.sampled_from([tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT]))
    exts = draw(
        st.lists(st.sampled_from(["txt", "json", "npy", "jpg", "cls", "seg.png"]), min_size=1, max_size=3, unique=True)
    )
    n = draw(st.integers(1, 12))
    long_dir = draw(st.booleans()) and fmt != tarfile.USTAR_FORMAT
    samples = []
    for i in range(n):
        stem = f"s{i:03d}" + ("x" * draw(st.integers(0, 90)) if fmt != tarfile.USTAR_FORMAT else "")
        key = (("d" * 80 + "/" if long_dir else "dir/") + stem) if draw(st.booleans()) else stem
        size = draw(st.sampled_from([0, 1, 511, 512, 513, 3000]))
        samples.append((key, {e: bytes([(i + j) % 251]) * size for j, e in enumerate(exts)}))
    return fmt, samples
