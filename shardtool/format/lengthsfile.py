"""Reading a dataset's lengths file (one ``.npy`` of every sample's length): whole, checked
against the manifest, or a range of it by one ranged read, so a planner reads only its own share."""

from __future__ import annotations

import numpy as np

from .errors import FormatError
from .fields import npy_layout
from .hashing import hash_bytes
from .manifest import Manifest, check_length_summary, lengths_from_bytes
from .storage import cat_shared, read_file

__all__ = ["read_lengths", "read_lengths_range"]


def read_lengths(fs, path: str, manifest: Manifest, url: str) -> np.ndarray:
    """Every sample's length, checked against the manifest's hash, count and length summary."""
    lf = manifest.lengths_file
    data = read_file(fs, path, what=f"dataset {url}")
    if lf.get("hash") and hash_bytes(data) != lf["hash"]:
        raise FormatError(f"{url}: {lf['path']} does not match the hash in the manifest")
    lengths = lengths_from_bytes(data, expected=manifest.num_samples, source=lf["path"])
    check_length_summary(lengths, manifest.length.get("summary"), source=lf["path"])
    return lengths


def read_lengths_range(fs, path: str, num_samples: int, lo: int, hi: int, url: str) -> np.ndarray:
    """Lengths of samples ``[lo, hi)``: the ``.npy`` header, then one ranged read of the range
    (both through `cat_shared`, so ranks of a node share them where the node shares metadata)."""
    if not 0 <= lo <= hi <= num_samples:
        raise ValueError(f"sample range [{lo}, {hi}) is outside [0, {num_samples}]")
    try:
        head = cat_shared(fs, path, 0, 4096)
        dtype, shape, _, offset = npy_layout(head)
        if len(shape) != 1 or shape[0] != num_samples or dtype.kind not in "iu":
            raise ValueError(f"expected {num_samples} integer lengths, found {shape} {dtype}")
        if hi == lo:
            return np.zeros(0, np.int64)
        size = dtype.itemsize
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
