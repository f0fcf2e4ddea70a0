"""``shardtool verify``: rehash every shard and check every index entry against its shard.

Never raises on a bad shard: every shard is checked and each problem is reported with the
shard's path, so one run lists all the damage.
"""
from __future__ import annotations

import mmap
import os
from typing import Callable

import pyarrow as pa

from ..format.arrowshard import KEY_COLUMN, check_schema
from ..format.dataset import Dataset, is_local, open_dataset
from ..format.errors import FormatError
from ..format.hashing import check_algo, hash_bytes
from ..format.tarshard import check_sample_range


def _shard_bytes(ds: Dataset, shard: int):
    path = ds.shard_path(shard)
    if is_local(ds.fs):
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            return mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else b""
        finally:
            os.close(fd)
    return ds.fs.cat_file(path)


def verify_shard(ds: Dataset, shard: int) -> None:
    info = ds.manifest.shards[shard]
    check_algo(info.hash)
    try:
        data = _shard_bytes(ds, shard)
    except FileNotFoundError:
        raise FormatError(f"{info.path}: shard file is missing") from None
    try:
        if len(data) != info.bytes:
            raise FormatError(f"{info.path}: {len(data)} bytes on disk, manifest says {info.bytes} (truncated?)")
        if hash_bytes(data) != info.hash:
            raise FormatError(f"{info.path}: content hash does not match the manifest (corrupted)")
        idx = ds.shard_index(shard)  # checks the index's own hash, count, ranges and lengths
        if ds.manifest.shard_format == "tar":
            exts = [f.ext for f in ds.manifest.fields]
            for i, key in enumerate(idx.keys):
                off, size = int(idx.offsets[i]), int(idx.sizes[i])
                check_sample_range(data[off : off + size], key, exts, idx.field_offsets[i], idx.field_sizes[i],
                                   info.path)
        else:
            _verify_arrow(ds, shard, data, idx)
    finally:
        if isinstance(data, mmap.mmap):
            data.close()


def _verify_arrow(ds: Dataset, shard: int, data, idx) -> None:
    info = ds.manifest.shards[shard]
    # Raise only after the reader is gone: an exception's traceback keeping it (and so a view of
    # the mmap) alive makes the caller's mmap.close() fail with BufferError.
    problem = None
    keys: list[list[str]] = []
    try:
        reader = pa.ipc.open_file(pa.py_buffer(data))
        try:
            check_schema(reader.schema, ds.manifest.fields, info.path)
            for b in range(reader.num_record_batches):
                keys.append(reader.get_batch(b).column(0).to_pylist())
        except FormatError as e:
            problem = str(e)
        del reader
    except pa.ArrowInvalid as e:
        problem = f"{info.path}: not a readable Arrow IPC file ({e})"
    if problem is not None:
        raise FormatError(problem)
    for i, key in enumerate(idx.keys):
        b, r = int(idx.batch[i]), int(idx.row[i])
        if not (0 <= b < len(keys) and 0 <= r < len(keys[b])) or keys[b][r] != key:
            raise FormatError(f"{info.path}: index entry #{i} ({key!r}) does not match the shard's row")
    if sum(len(k) for k in keys) != len(idx.keys):
        raise FormatError(f"{info.path}: {sum(len(k) for k in keys)} rows in the shard, index has {len(idx.keys)}")


def verify(url: str, *, storage_options: dict | None = None,
           progress: Callable[[int], None] | None = None) -> dict:
    """Check a dataset; returns {"ok", "shards", "samples", "bytes", "bad": [{"shard", "error"}]}."""
    ds = open_dataset(url, storage_options=storage_options)
    bad = []
    try:
        _ = ds.lengths  # the global lengths file against its manifest hash
    except FormatError as e:
        bad.append({"shard": ds.manifest.lengths_file.get("path", "lengths.npy"), "error": str(e)})
    for s in range(ds.num_shards):
        try:
            verify_shard(ds, s)
        except FormatError as e:
            bad.append({"shard": ds.manifest.shards[s].path, "error": str(e)})
        except OSError as e:
            bad.append({"shard": ds.manifest.shards[s].path, "error": f"{ds.manifest.shards[s].path}: {e}"})
        if progress is not None:
            progress(1)
    ds.close()
    return {"ok": not bad, "url": url, "shards": ds.num_shards, "samples": ds.manifest.num_samples,
            "bytes": ds.manifest.num_bytes, "version": ds.version, "bad": bad}
