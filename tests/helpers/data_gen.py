"""Small, general test-data builders: token JSONL/Parquet, image-like file trees, tar shards."""

from __future__ import annotations

import gzip
import io
import json
import os
import tarfile

import numpy as np


def token_records(n: int, seed: int = 0, max_len: int = 64) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {
            "tokens": rng.integers(0, 1000, int(rng.integers(1, max_len))).tolist(),
            "text": f"doc {i}",
            "label": int(i % 7),
        }
        for i in range(n)
    ]


def write_jsonl(path: str, records: list, *, compress: str | None = None, raw_lines: list[str] | None = None) -> str:
    """Records as JSON lines (or ``raw_lines`` verbatim); ``compress`` = None | "gz" | "zst"."""
    lines = raw_lines if raw_lines is not None else [json.dumps(r) for r in records]
    data = ("\n".join(lines) + "\n").encode()
    if compress == "gz":
        data = gzip.compress(data, mtime=0)
    elif compress == "zst":
        import zstandard

        data = zstandard.ZstdCompressor().compress(data)
    with open(path, "wb") as f:
        f.write(data)
    return path


def write_parquet(path: str, records: list[dict], *, row_group_size: int = 16, token_dtype=np.int32) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    cols = {}
    for name in records[0]:
        vals = [r[name] for r in records]
        if isinstance(vals[0], list):
            cols[name] = pa.array(
                [np.asarray(v, dtype=token_dtype) for v in vals],
                type=pa.list_(pa.from_numpy_dtype(np.dtype(token_dtype))),
            )
        else:
            cols[name] = pa.array(vals)
    pq.write_table(pa.table(cols), path, row_group_size=row_group_size)
    return path


def image_samples(n: int, seed: int = 0, size: int = 2000) -> dict[str, dict[str, bytes]]:
    rng = np.random.default_rng(seed)
    return {
        f"{i:05d}": {"jpg": rng.bytes(int(rng.integers(1, size))), "json": json.dumps({"i": i}).encode()}
        for i in range(n)
    }


def write_tree(root: str, samples: dict[str, dict[str, bytes]], *, subdirs: int = 0) -> str:
    for i, (key, fields) in enumerate(samples.items()):
        d = os.path.join(root, f"d{i % subdirs}") if subdirs else root
        os.makedirs(d, exist_ok=True)
        for ext, data in fields.items():
            with open(os.path.join(d, f"{key}.{ext}"), "wb") as f:
                f.write(data)
    return root


def write_tar(path: str, members: list[tuple[str, bytes]], *, links: list[tuple[str, str]] = ()) -> str:
    """A tar with regular members ``(name, payload)`` and symlinks ``(name, target)``."""
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        for name, target in links:
            info = tarfile.TarInfo(name)
            info.type = tarfile.SYMTYPE
            info.linkname = target
            tf.addfile(info)
    return path


def tar_of_samples(path: str, samples: dict[str, dict[str, bytes]]) -> str:
    return write_tar(path, [(f"{k}.{e}", v) for k, f in samples.items() for e, v in f.items()])


def dir_digest(root: str) -> dict[str, bytes]:
    """Every file under root (relative path → bytes), for byte-identity comparisons."""
    out = {}
    for d, _, files in os.walk(root):
        for name in files:
            p = os.path.join(d, name)
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = f.read()
    return out


def read_all(url: str, *, decode: bool = True) -> dict[str, dict]:
    """key → decoded sample of a packed dataset, read through the public API."""
    import shardtool

    ds = shardtool.open_dataset(url)
    out = {}
    for s in range(ds.num_shards):
        for i in range(int(ds.shard_counts[s])):
            smp = ds.read(s, i, decode=decode)
            key = smp.pop("__key__")
            assert key not in out, f"key {key} read twice"
            out[key] = smp
    ds.close()
    return out


def pack_compressed_pairs(rows, root, codecs, shard_size: int) -> dict:
    """``rows`` packed as Arrow shards once per codec in ``codecs`` (None: plain) under ``root``;
    {codec: dataset path}. Compressed ones in 64 KiB record batches (the default before 1 MiB):
    several a shard, the layout of compressed datasets packed before, which every reader keeps
    reading."""
    import shardtool

    out = {}
    for comp in codecs:
        out[comp] = str(root / (comp or "plain"))
        shardtool.pack(
            rows,
            out[comp],
            format="arrow",
            length="tokens",
            shard_size=shard_size,
            compression=comp,
            record_batch_size="64KiB" if comp else None,
        )
    return out


def packed_rows_dataset(root: str, fmt: str, dtype: str):
    """300 token documents (0-89 tokens, seed 3) in three shards of ``fmt``/``dtype`` ids under
    1000, and their rows of 64 tokens (best-fit, eos 999) planned over the documents in reverse,
    so that a batch's window order is not id order; (dataset, lengths, packing, rows)."""
    from shardtool.pack.synthetic import write_synthetic
    from shardtool.plan.packing import Packing, pack_rows

    lengths = np.random.default_rng(3).integers(0, 90, 300)
    ds = write_synthetic(root, lengths=lengths, shard_sizes=[100, 120, 80], fmt=fmt, dtype=dtype, vocab=1000)
    packing = Packing(64, "best-fit", eos_id=999)
    rows = pack_rows(lengths[::-1], packing).with_ids(np.arange(len(lengths))[::-1])
    return ds, lengths, packing, rows
