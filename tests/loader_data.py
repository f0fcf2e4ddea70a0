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
