"""Small packed datasets for the loader's tests, written with the format's own writers."""
from __future__ import annotations

import os

import numpy as np

from shardtool.format import FieldSpec, Manifest, ShardFileWriter, publish_manifest


def token_fields(dtype: str = "i4", extra: bool = True) -> list[FieldSpec]:
    fields = [FieldSpec("tokens", "tokens.npy", "npy", "array", dtype)]
    if extra:
        fields += [FieldSpec("text", "text.txt", "txt", "text"), FieldSpec("meta", "meta.json", "json", "json"),
                   FieldSpec("bin", "bin", "bytes", "raw")]
    return fields


def write_dataset(root: str, shard_sizes: list[int], *, fmt: str = "tar", lengths: np.ndarray | None = None,
                  seed: int = 0, extra: bool = True, dtype: str = "i4", prefix: str = "s") -> tuple[str, list[str]]:
    """A dataset of token samples split into shards of the given sizes; returns (root, keys)."""
    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(seed)
    total = int(sum(shard_sizes))
    if lengths is None:
        lengths = rng.integers(1, 40, size=total)
    fields = token_fields(dtype, extra)
    infos, all_lengths, keys = [], [], []
    g = 0
    for s, size in enumerate(shard_sizes):
        ext = "tar" if fmt == "tar" else "arrow"
        w = ShardFileWriter(root, f"shard-{s:05d}.{ext}", fmt, fields)
        for _ in range(size):
            n = int(lengths[g])
            key = f"{prefix}{g:06d}"
            toks = (np.arange(n, dtype=np.int64) + g * 7) % 30000
            values = [toks.astype(np.dtype(dtype))]
            if extra:
                values += [f"text of {key}", {"id": g, "k": key}, bytes([g % 251]) * (g % 5)]
            w.add(key, values, n, approx_bytes=n * 4)
            keys.append(key)
            g += 1
        info, lens = w.finish()
        infos.append(info)
        all_lengths.append(lens)
    m = Manifest(fmt, fields, infos, {"field": "tokens", "unit": "tokens", "fn": None})
    publish_manifest(root, m, np.concatenate(all_lengths) if all_lengths else np.zeros(0, np.int64))
    return root, keys


def read_all(loader) -> list[list[str]]:
    """The keys of every batch one pass of ``loader`` yields."""
    return [list(b["__key__"]) for b in loader]


def test_helper_writes_a_readable_dataset(tmp_path):
    from shardtool.format import open_dataset

    root, keys = write_dataset(str(tmp_path / "d"), [3, 0, 2])
    ds = open_dataset(root)
    assert len(ds) == 5 and ds.read(2, 1)["__key__"] == keys[4]
