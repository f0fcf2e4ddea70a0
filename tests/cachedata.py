"""A synthetic packed dataset for cache tests and benchmarks (tar shards, random lengths)."""
from __future__ import annotations

import dataclasses
import os
import shutil

import numpy as np

from shardtool.format import Manifest, ShardFileWriter, infer_field, publish_manifest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env() -> dict:
    """Environment for a warmer or reader in a subprocess: this checkout importable, and no SLURM_*
    variables of an enclosing job (they would change the node layout the warmer resolves)."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    e["PYTHONPATH"] = REPO
    return e


def make_dataset(root: str, *, shards: int = 8, samples: int = 10, sample_bytes: int = 1000,
                 seed: int = 0, subdir: str = "shards", replicate: bool = False) -> str:
    """Pack ``shards`` tar shards of ``samples`` samples (~``sample_bytes`` each) under ``root``.
    ``replicate`` packs one shard and copies it (same content, other names): fast for 1,000s."""
    rng = np.random.default_rng(seed)
    os.makedirs(root, exist_ok=True)
    fields = [infer_field("bin", b"")]
    infos, lengths = [], []
    for s in range(shards):
        if replicate and infos:
            rel = f"{subdir}/{s:06d}.tar"
            shutil.copyfile(os.path.join(root, infos[0].path), os.path.join(root, rel))
            idx = rel.rsplit(".", 1)[0] + ".idx.arrow"
            shutil.copyfile(os.path.join(root, infos[0].index), os.path.join(root, idx))
            infos.append(dataclasses.replace(infos[0], path=rel, index=idx))
            lengths.append(lengths[0])
            continue
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
