"""The one synthetic-dataset writer: packed datasets for tests, benchmarks and `shardtool bench --generate`.

Samples are written straight through the format's shard writer (no raw files, no pack workers), so
building a 200k-sample corpus takes seconds. Everything is a deterministic function of the
arguments: sample ``g``'s tokens are ``(arange(n) + 7 g) mod vocab`` (a test can recompute them),
its bytes a slice of one seeded random blob.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..format import FieldSpec, Manifest, ShardFileWriter, ShardInfo, infer_field, publish_manifest
from ..plan.synthetic import lognormal_lengths

__all__ = ["SyntheticDataset", "token_fields", "write_synthetic"]


@dataclass(frozen=True)
class SyntheticDataset:
    root: str
    keys: list[str]
    lengths: np.ndarray


def token_fields(dtype: str = "i4", extra: bool = False) -> list[FieldSpec]:
    """``tokens`` (a 1-D integer array, the length field) and optionally a text, a JSON and a bytes field."""
    fields = [FieldSpec("tokens", "tokens.npy", "npy", "array", dtype)]
    if extra:
        fields += [
            FieldSpec("text", "text.txt", "txt", "text"),
            FieldSpec("meta", "meta.json", "json", "json"),
            FieldSpec("bin", "bin", "bytes", "raw"),
        ]
    return fields


def tokens_of(g: int, n: int, vocab: int, dtype: str) -> np.ndarray:
    """The tokens the writer stores for sample ``g`` of length ``n``."""
    return ((np.arange(n, dtype=np.int64) + g * 7) % vocab).astype(np.dtype(dtype))


def _shard_sizes(n: int | None, shard_sizes: Sequence[int] | None, samples_per_shard: int) -> list[int]:
    if shard_sizes is not None:
        return [int(s) for s in shard_sizes]
    if n is None:
        raise ValueError("give n (with samples_per_shard) or shard_sizes")
    full, rest = divmod(int(n), samples_per_shard)
    return [samples_per_shard] * full + ([rest] if rest else [])


def write_synthetic(
    root: str,
    n: int | None = None,
    *,
    shard_sizes: Sequence[int] | None = None,
    samples_per_shard: int = 2000,
    lengths: np.ndarray | None = None,
    kind: str = "tokens",
    fmt: str = "tar",
    dtype: str = "i4",
    extra_fields: bool = False,
    field: str = "bin",
    seed: int = 0,
    vocab: int = 32000,
    sample_bytes: int = 1000,
    key_prefix: str = "s",
    key_width: int = 9,
    shard_name: str = "shards/shard-{:06d}",
    replicate: bool = False,
) -> SyntheticDataset:
    """Write a packed dataset under ``root``.

    ``kind="tokens"``: the length field ``tokens`` (dtype ``dtype``), ``extra_fields`` adds text/meta/bin;
    lengths default to the lognormal corpus (`shardtool.plan.synthetic`). ``kind="bytes"``: one raw
    field ``field`` of ~``sample_bytes`` random bytes, length = byte count. Shards are ``shard_sizes``
    samples each, or ``n`` samples in shards of ``samples_per_shard``, named ``shard_name`` (a format
    string of the shard's number) + the format's extension. ``replicate`` writes the first
    shard once and copies it under the other names (same content): fast for thousands of shards.
    """
    if kind not in ("tokens", "bytes"):
        raise ValueError(f"kind must be 'tokens' or 'bytes', found {kind!r}")
    sizes = _shard_sizes(n, shard_sizes, samples_per_shard)
    total = sum(sizes)
    rng = np.random.default_rng([seed, 0])
    if lengths is None:
        if kind == "tokens":
            lengths = lognormal_lengths(total, seed=seed)
        else:
            lengths = rng.integers(sample_bytes // 2, sample_bytes * 3 // 2 + 1, size=total)
    lengths = np.asarray(lengths, dtype=np.int64)
    if replicate and sizes:
        if len(set(sizes)) > 1:
            raise ValueError("replicate needs shards of one size")
        lengths = np.tile(lengths[: sizes[0]], len(sizes))
    if lengths.size != total:
        raise ValueError(f"{lengths.size} lengths for {total} samples")
    if kind == "tokens":
        fields = token_fields(dtype, extra_fields)
        length_def = {"field": "tokens", "unit": "tokens", "fn": None}
    else:
        fields = [infer_field(field, b"")]
        length_def = {"field": field, "unit": "bytes", "fn": None}
        blob = rng.bytes(int(lengths.max(initial=0)) + 4096)
    os.makedirs(root, exist_ok=True)
    ext = "tar" if fmt == "tar" else "arrow"
    infos: list[ShardInfo] = []
    keys: list[str] = []
    g = 0
    for s, size in enumerate(sizes):
        rel = f"{shard_name.format(s)}.{ext}"
        if replicate and infos:
            _copy_shard(root, infos[0], rel, infos)
            keys.extend(keys[:size])
            g += size
            continue
        w = ShardFileWriter(root, rel, fmt, fields)
        for _ in range(size):
            k = int(lengths[g])
            key = f"{key_prefix}{g:0{key_width}d}"
            if kind == "tokens":
                values: list[object] = [tokens_of(g, k, vocab, dtype)]
                if extra_fields:
                    values += [f"text of {key}", {"id": g, "k": key}, bytes([g % 251]) * (g % 5)]
            else:
                at = (g * 7919) % 4096
                values = [blob[at : at + k]]
            w.add(key, values, k, approx_bytes=k * 4 if kind == "tokens" else k)
            keys.append(key)
            g += 1
        infos.append(w.finish()[0])
    manifest = Manifest(fmt, fields, infos, length_def)
    publish_manifest(root, manifest, lengths)
    return SyntheticDataset(root, keys, lengths)


def _copy_shard(root: str, first, rel: str, infos: list) -> None:
    shutil.copyfile(os.path.join(root, first.path), os.path.join(root, rel))
    index = rel.rsplit(".", 1)[0] + ".idx.arrow"
    shutil.copyfile(os.path.join(root, first.index), os.path.join(root, index))
    infos.append(dataclasses.replace(first, path=rel, index=index))
