"""WebDataset tars as other tools write them (Python's tarfile, GNU and PAX headers), for the
tests of `shardtool index` and of packing tars."""

from __future__ import annotations

import io
import json
import os
import tarfile

from helpers.realtext import stdlib_files


def add(tf: tarfile.TarFile, name: str, data: bytes, **attrs) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    for k, v in attrs.items():
        setattr(info, k, v)
    tf.addfile(info, io.BytesIO(data))


def write_tar(path: str, samples: list[tuple[str, dict[str, bytes]]], *, fmt=tarfile.PAX_FORMAT) -> str:
    with tarfile.open(path, "w", format=fmt) as tf:
        for key, fields in samples:
            for ext, data in fields.items():
                add(tf, f"{key}.{ext}", data)
    return path


def text_samples(shard: int, n: int, *, subdir: bool = False) -> list[tuple[str, dict[str, bytes]]]:
    out = []
    for i in range(n):
        text = (f"shard {shard} sample {i} " * (1 + (i * 7 + shard) % 13)).encode()
        key = f"part{shard}/s{i:04d}" if subdir else f"t{shard}_{i:04d}"
        out.append((key, {"txt": text, "json": json.dumps({"num_tokens": len(text) // 4, "i": i}).encode()}))
    return out


def write_collection(root: str, shards: int = 4, per_shard: int = 25, *, fmt=tarfile.PAX_FORMAT) -> list[str]:
    os.makedirs(root, exist_ok=True)
    return [
        write_tar(os.path.join(root, f"{s:06d}.tar"), text_samples(s, per_shard, subdir=s % 2 == 1), fmt=fmt)
        for s in range(shards)
    ]


def write_stdlib_tars(root: str, shards: int = 3, per_shard: int = 40) -> list[str]:
    """Real text: Python's own source files, one sample each (py + json with its byte count)."""
    files = stdlib_files(shards * per_shard)
    os.makedirs(root, exist_ok=True)
    paths = []
    for s in range(shards):
        samples = []
        for j, f in enumerate(files[s * per_shard : (s + 1) * per_shard]):
            data = open(f, "rb").read()
            samples.append((f"py{s}_{j:04d}", {"py": data, "json": json.dumps({"num_tokens": len(data)}).encode()}))
        paths.append(write_tar(os.path.join(root, f"src-{s:03d}.tar"), samples, fmt=tarfile.GNU_FORMAT))
    return paths
