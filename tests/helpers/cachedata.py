"""A synthetic packed dataset for cache tests and benchmarks (tar shards, random lengths)."""

from __future__ import annotations

import os

from shardtool.pack.synthetic import write_synthetic

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout


def child_env() -> dict:
    """Environment for a warmer or reader in a subprocess: this checkout importable, and no SLURM_*
    variables of an enclosing job (they would change the node layout the warmer resolves)."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    e["PYTHONPATH"] = REPO
    return e


def make_dataset(
    root: str, *, shards: int = 8, samples: int = 10, sample_bytes: int = 1000, seed: int = 0, replicate: bool = False
) -> str:
    """``shards`` tar shards of ``samples`` samples of ~``sample_bytes`` random bytes each, under ``root``.
    ``replicate`` packs one shard and copies it (same content, other names): fast for 1,000s."""
    return write_synthetic(
        root,
        shard_sizes=[samples] * shards,
        kind="bytes",
        sample_bytes=sample_bytes,
        seed=seed,
        replicate=replicate,
        shard_name="shards/{:06d}",
    ).root
