"""The pieces of packed rows read from a remote tar dataset without a cache: each by range.

A packed row holds a piece of a document (elements ``start : start + length`` of its tokens), and
a long document's pieces are spread over the whole pass (a few hundred batches apart at seq_len
256). Read as whole samples, a document of 1 MB split into 2,000 pieces was fetched 2,000 times:
300 batches of 1.2 MB of tokens fetched 400 MB. A piece is a slice of its sample's npy payload
(the header, then the elements), and the sample index gives everything to locate it: the
payload's offset and size, and the element count (the length), so the header is the size less
the elements' bytes. So only the piece's bytes are fetched, neighbours within the coalescing gap
in one request.

The index's checksum covers a whole sample, so a slice cannot be checked against it: a piece that
is its whole document is read as its sample and checked, as every other read is; a part of a
document is read unchecked (its bytes are the only ones fetched, there is nothing to check it with).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..format import FieldSpec, FormatError
from ..format.coalesce import read_coalesced
from ..format.fields import npy_layout
from ..format.storage import open_range
from .shardview import is_int_array
from .tokenpieces import TokenSources

__all__ = ["piece_sources"]

NPY_MIN_HEADER = 10  # magic (6), version (2), header length (2)


def token_spec(ds: Any) -> tuple[int, FieldSpec] | None:
    """(column, spec) of the dataset's length field where its payloads are plain npy arrays of
    integers (a packed row's tokens), else None (its samples are decoded whole)."""
    m = ds.manifest
    name = m.length.get("field")
    for j, spec in enumerate(m.fields):
        if spec.name == name:
            return (j, spec) if is_int_array(spec) and spec.encoding == "npy" else None
    return None


def piece_sources(
    ds: Any,
    shard: np.ndarray,
    local: np.ndarray,
    start: np.ndarray,
    length: np.ndarray,
    *,
    gap: int | None,
    watch_of: Callable[[int], Any],
    opening: Callable[[int], Any],
    keys: bool,
) -> TokenSources | None:
    """`TokenSources` of the pieces (``start``, ``length``: elements, eos included) of samples
    (``shard``, ``local``), each piece's buffer holding only its elements from ``start`` (so
    ``first`` is ``-start``: a piece's element ``start`` lies at 0). ``watch_of(shard)`` watches
    and counts each request, ``opening(shard)`` is a context around a shard's reads. None where
    the tokens are not plain npy arrays (the caller decodes samples)."""
    col = token_spec(ds)
    if col is None:
        return None
    j, spec = col
    item = np.dtype(spec.dtype).itemsize
    n = len(shard)
    start = np.asarray(start, dtype=np.int64)
    counts = np.empty(n, np.int64)
    bufs: list[Any] = [b""] * n
    names: list[Any] = [None] * n if keys else []
    plans = []
    for s in np.unique(shard).tolist():
        rows = np.flatnonzero(shard == s)
        idx = ds.shard_index(s)
        li = local[rows]
        docs = idx.lengths[li].astype(np.int64)
        header = idx.field_sizes[li, j].astype(np.int64) - docs * item
        if (header < NPY_MIN_HEADER).any():
            return None  # not an npy array of the manifest's dtype: decoded whole, which says why
        counts[rows] = docs
        if keys:
            for r, i in zip(rows.tolist(), li.tolist()):
                names[r] = idx.keys[i]
        plans.append((s, rows, li, idx, docs, header))
    for s, rows, li, idx, docs, header in plans:
        with opening(s):
            _read_shard(ds, s, rows, li, idx, docs, header, start, length, j, item, gap, watch_of(s), bufs)
    return TokenSources(names, bufs, np.arange(n, dtype=np.int64), -start, counts, np.dtype(spec.dtype))


def _read_shard(ds, s, rows, li, idx, docs, header, start, length, j, item, gap, watch, bufs) -> None:
    """Fill ``bufs[rows]`` with the pieces of shard ``s``: whole documents as their checked samples,
    parts of documents as their slices."""
    a = start[rows]
    take = np.minimum(np.asarray(length, dtype=np.int64)[rows], np.maximum(docs - a, 0))  # the eos is not stored
    whole = (a == 0) & (take == docs) & (docs > 0)
    field_at = idx.field_offsets[li, j].astype(np.int64)
    w = np.flatnonzero(whole)
    if w.size:
        where = ds.manifest.shards[s].path
        dtype = np.dtype(ds.manifest.fields[j].dtype)
        for k, blob in zip(w.tolist(), ds.verified_ranges(s, li[w].tolist(), gap, watch)):
            fo, h = int(field_at[k]), int(header[k])
            try:
                layout = npy_layout(blob[fo : fo + h])
            except ValueError:
                layout = None
            if layout is None or layout[0] != dtype or layout[1] != (int(docs[k]),) or layout[3] != h:
                raise FormatError(f"shard {where} sample #{int(li[k])}: its tokens are not an npy array of {dtype}")
            bufs[int(rows[k])] = blob[fo + h : fo + h + int(docs[k]) * item]
    p = np.flatnonzero(~whole & (take > 0))
    if p.size:
        at = idx.offsets[li[p]].astype(np.int64) + field_at[p] + header[p] + a[p] * item
        rng = open_range(ds.shard_fs(s), ds.shard_path(s))
        try:
            got = read_coalesced(rng.read, at, take[p] * item, gap, watch)
        finally:
            rng.close()
        for k, data in zip(p.tolist(), got):
            bufs[int(rows[k])] = data
