"""Synthetic corpora for benchmarks and the README demo, deterministic from a seed.

- tokens: N samples of int32 token ids, the lognormal lengths of `shardtool.plan.synthetic`
  (median ≈ 350, clipped to 1..8192),
  plus a short ``source`` string; written as JSONL (``tokens.jsonl``) and Parquet
  (``tokens.parquet``, row groups of 8192 rows so several workers can share one file).
- images: N image-like samples as ``<key>.bin`` (~100 KB of incompressible bytes) + ``<key>.json``
  (small metadata), in 1,000-sample subdirectories like a real image dump.

    python -m benchmarks.corpus tokens OUT --n 200000
    python -m benchmarks.corpus images OUT --n 20000
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from shardtool.plan.synthetic import lognormal_lengths

VOCAB = 50_000
ROW_GROUP = 8192


def token_lengths(n: int, seed: int = 0) -> np.ndarray:
    return lognormal_lengths(n, seed=np.random.default_rng([seed, 1]))


def write_tokens(out: str, n: int, *, seed: int = 0, jsonl: bool = True, parquet: bool = True) -> dict[str, str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(out, exist_ok=True)
    lengths = token_lengths(n, seed)
    rng = np.random.default_rng([seed, 2])
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = rng.integers(0, VOCAB, int(offsets[-1]), dtype=np.int32)
    sources = [f"doc-{i % 97}" for i in range(n)]
    paths = {}
    if parquet:
        col = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values))
        table = pa.table({"tokens": col, "source": pa.array(sources)})
        paths["parquet"] = os.path.join(out, "tokens.parquet")
        # Token ids are high-entropy: a dictionary does not shrink them and triples decode time,
        # so (like most tokenized-corpus writers) only the string column is dictionary-encoded.
        pq.write_table(table, paths["parquet"], row_group_size=ROW_GROUP, use_dictionary=["source"], compression="zstd")
    if jsonl:
        paths["jsonl"] = os.path.join(out, "tokens.jsonl")
        with open(paths["jsonl"], "w") as f:
            for i in range(n):
                toks = values[offsets[i] : offsets[i + 1]].tolist()
                f.write(json.dumps({"tokens": toks, "source": sources[i]}, separators=(",", ":")) + "\n")
    return paths


def write_images(out: str, n: int, *, seed: int = 0, size: int = 100_000, per_dir: int = 1000) -> str:
    rng = np.random.default_rng([seed, 3])
    for i in range(n):
        d = os.path.join(out, f"{i // per_dir:04d}")
        if i % per_dir == 0:
            os.makedirs(d, exist_ok=True)
        nbytes = int(size * (0.5 + rng.random()))
        with open(os.path.join(d, f"{i:08d}.bin"), "wb") as f:
            f.write(rng.bytes(nbytes))
        with open(os.path.join(d, f"{i:08d}.json"), "w") as f:
            json.dump({"label": int(i % 1000), "width": 256, "height": 256}, f)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=["tokens", "images"])
    p.add_argument("out")
    p.add_argument("--n", type=int, default=None, help="samples (default 200000 tokens / 20000 images)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.kind == "tokens":
        print(write_tokens(a.out, a.n or 200_000, seed=a.seed))
    else:
        print(write_images(a.out, a.n or 20_000, seed=a.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
