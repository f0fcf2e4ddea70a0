"""A synthetic packed dataset for cache tests and benchmarks (tar shards, random lengths)."""
from __future__ import annotations

import os

import numpy as np

from shardtool.format import Manifest, ShardFileWriter, infer_field, publish_manifest


def make_dataset(root: str, *, shards: int = 8, samples: int = 10, sample_bytes: int = 1000,
                 seed: int = 0, subdir: str = "shards") -> str:
    """Pack ``shards`` tar shards of ``samples`` samples (~``sample_bytes`` each) under ``root``."""
    rng = np.random.default_rng(seed)
    os.makedirs(root, exist_ok=True)
    fields = [infer_field("bin", b"")]
    infos, lengths = [], []
    for s in range(shards):
        w = ShardFileWriter(root, f"{subdir}/{s:06d}.tar", "tar", fields)
        for k in range(samples):
            n = int(rng.integers(sample_bytes // 2, sample_bytes * 3 // 2 + 1))
            w.add(f"s{s:04d}k{k:05d}", [rng.bytes(n)], length=n)
        info, lens = w.finish()
        infos.append(info)
        lengths.append(lens)
    m = Manifest("tar", fields, infos, {"field": "bin", "unit": "bytes"})
    publish_manifest(root, m, np.concatenate(lengths) if lengths else np.zeros(0, np.int64))
    return root
