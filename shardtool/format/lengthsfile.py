"""Reading sample lengths: the dataset's lengths file (one ``.npy`` of every sample's length),
whole and checked against the manifest, or a range of it by one ranged read, so a planner reads
only its own share; or a range from the shards' sample indexes (a node cache holds those)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa

from .errors import FormatError
from .fields import npy_layout
from .hashing import hash_bytes
from .manifest import Manifest, check_length_summary, lengths_from_bytes
from .sindex import ShardIndex, as_numpy
from .storage import cat_shared, is_local, read_file

__all__ = ["lengths_from_indexes", "read_lengths", "read_lengths_range"]

_HEAD = 4096  # a .npy header fits (numpy pads version 1 headers to 64 bytes; ours are 128)
_INT64 = np.dtype("<i8")


def read_lengths(fs, path: str, manifest: Manifest, url: str) -> np.ndarray:
    """Every sample's length, checked against the manifest's hash, count and length summary."""
    lf = manifest.lengths_file
    data = read_file(fs, path, what=f"dataset {url}")
    if lf.get("hash") and hash_bytes(data) != lf["hash"]:
        raise FormatError(f"{url}: {lf['path']} does not match the hash in the manifest")
    lengths = lengths_from_bytes(data, expected=manifest.num_samples, source=lf["path"])
    check_length_summary(lengths, manifest.length.get("summary"), source=lf["path"])
    return lengths


def read_lengths_range(
    fs, path: str, num_samples: int, lo: int, hi: int, url: str, file_bytes: int | None = None
) -> np.ndarray:
    """Lengths of samples ``[lo, hi)``: the ``.npy`` header and one ranged read of the range
    (both through `cat_shared`, so ranks of a node share them where the node shares metadata).
    Given the file's size (``file_bytes``, the manifest's), the range is read beside the header,
    where the int64 values this package writes would start, not after it: one request's wait
    at every rank's start, not two. Another layout reads the range again where the header says."""
    if not 0 <= lo <= hi <= num_samples:
        raise ValueError(f"sample range [{lo}, {hi}) is outside [0, {num_samples}]")
    guess = None if file_bytes is None else file_bytes - num_samples * _INT64.itemsize
    try:
        with contextlib.ExitStack() as stack:
            ahead = None
            if guess is not None and 0 < guess <= _HEAD and hi > lo and not is_local(fs):
                size = _INT64.itemsize  # a local file's reads do not wait: no thread for them
                pool = stack.enter_context(ThreadPoolExecutor(1))
                ahead = pool.submit(cat_shared, fs, path, guess + lo * size, guess + hi * size)
            head = cat_shared(fs, path, 0, _HEAD)
            dtype, shape, _, offset = npy_layout(head)
            if len(shape) != 1 or shape[0] != num_samples or dtype.kind not in "iu":
                raise ValueError(f"expected {num_samples} integer lengths, found {shape} {dtype}")
            if hi == lo:
                return np.zeros(0, np.int64)
            size = dtype.itemsize
            if ahead is not None and offset == guess and dtype == _INT64:
                data = ahead.result()
            else:
                data = cat_shared(fs, path, offset + lo * size, offset + hi * size)
    except FileNotFoundError:
        raise FormatError(f"dataset {url}: lengths file {path} not found") from None
    except ValueError as e:
        raise FormatError(f"dataset {url}: unreadable lengths file {path} ({e})") from None
    if len(data) != (hi - lo) * size:
        raise FormatError(f"dataset {url}: lengths file {path} is cut short")
    out = np.frombuffer(data, dtype=dtype).astype(np.int64)
    if out.size and int(out.min()) < 0:
        raise FormatError(f"dataset {url}: negative length in {path}")
    return out


def lengths_from_indexes(
    manifest: Manifest,
    offsets: np.ndarray,
    loaded: Callable[[int], ShardIndex | None],
    index_bytes: Callable[[int], bytes],
    lo: int,
    hi: int,
) -> np.ndarray:
    """Lengths of samples ``[lo, hi)`` from the sample indexes of the shards holding them: an
    index ``loaded(shard)`` has, else only the length column of ``index_bytes(shard)`` (checked
    bytes). ``offsets``: shard s holds samples ``[offsets[s], offsets[s + 1])``."""
    first = int(np.searchsorted(offsets, lo, side="right")) - 1
    parts = []
    for shard in range(max(first, 0), len(manifest.shards)):
        begin, end = int(offsets[shard]), int(offsets[shard + 1])
        if begin >= hi:
            break
        if end <= lo:
            continue
        idx = loaded(shard)
        if idx is not None:
            column = idx.lengths
        else:
            info = manifest.shards[shard]
            try:
                table = pa.ipc.open_file(pa.py_buffer(index_bytes(shard))).read_all()
                column = as_numpy(table.column("length")).astype(np.int64, copy=False)
            except (pa.ArrowInvalid, OSError, KeyError) as e:
                raise FormatError(f"{info.path}: sample index is unreadable ({e})") from None
            if column.size != info.samples:
                raise FormatError(f"{info.path}: index has {column.size} samples, manifest says {info.samples}")
        parts.append(column[max(lo, begin) - begin : min(hi, end) - begin])
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)
