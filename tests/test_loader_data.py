"""Small packed datasets for the loader's tests: the project's one synthetic writer, with test defaults."""

from __future__ import annotations

import numpy as np

from shardtool.pack.synthetic import token_fields, write_synthetic

__all__ = ["read_all", "token_fields", "write_dataset"]


def write_dataset(
    root: str,
    shard_sizes: list[int],
    *,
    fmt: str = "tar",
    lengths: np.ndarray | None = None,
    seed: int = 0,
    extra: bool = True,
    dtype: str = "i4",
    prefix: str = "s",
) -> tuple[str, list[str]]:
    """A dataset of token samples (lengths 1..39 unless given) in shards of the given sizes; (root, keys)."""
    if lengths is None:
        lengths = np.random.default_rng(seed).integers(1, 40, size=int(sum(shard_sizes)))
    ds = write_synthetic(
        root,
        shard_sizes=shard_sizes,
        lengths=lengths,
        fmt=fmt,
        dtype=dtype,
        extra_fields=extra,
        seed=seed,
        vocab=30000,
        key_prefix=prefix,
        key_width=6,
        shard_name="shard-{:05d}",
    )
    return ds.root, ds.keys


def read_all(loader) -> list[list[str]]:
    """The keys of every batch one pass of ``loader`` yields."""
    return [list(b["__key__"]) for b in loader]


def test_helper_writes_a_readable_dataset(tmp_path):
    from shardtool.format import open_dataset

    root, keys = write_dataset(str(tmp_path / "d"), [3, 0, 2])
    ds = open_dataset(root)
    assert len(ds) == 5 and ds.read(2, 1)["__key__"] == keys[4]
    assert (ds.read(2, 1)["tokens"] == (np.arange(len(ds.read(2, 1)["tokens"])) + 4 * 7) % 30000).all()
