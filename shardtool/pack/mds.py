"""A MosaicML Streaming (MDS) directory as a pack source, read from its documented format
(streaming's ``base/format/mds``), without the ``streaming`` package:

    index.json: {"version": 2, "shards": [{"format": "mds", "column_names": [...],
                 "column_encodings": [...], "column_sizes": [int|null, ...], "samples": N,
                 "compression": null | "zstd:7" | ..., "raw_data": {"basename", "bytes", "hashes"},
                 "zip_data": null | {"basename", "bytes", "hashes"}}, ...]}
    shard:      uint32 N, uint32 offsets[N + 1] (from the file's start), the shard's config JSON,
                then per sample: a uint32 size for each variable-size column, then every
                column's bytes in column order.

Columns become fields with their types kept: ``bytes``/``jpeg``/``png`` → binary (the encoded
image, as stored), ``str`` → string, ``int``/``str_int`` → int64, fixed-size scalars → their
dtype, ``str_float`` → float64, 1-D ``ndarray`` → a list of its dtype, ``json`` → its text
decoded into Arrow values. ``pkl`` is refused (unpickling runs code), as are ``pil`` and other
multi-dimensional forms we cannot keep. A shard whose size or recorded hash disagrees with
index.json is an error naming it; compressed shards are decompressed in memory, one at a time.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
from collections.abc import Iterator

import numpy as np

from ..format.errors import BadSampleError, FormatError
from ..format.manifest import safe_relpath
from .workunit import Unit

SCALARS = {"uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64", "float16", "float32", "float64"}
BINARY = {"bytes", "jpeg", "png"}
NDARRAY_DTYPES = {
    8: "uint8",
    9: "int8",
    16: "uint16",
    17: "int16",
    32: "uint32",
    33: "int32",
    64: "uint64",
    65: "int64",
    66: "float16",
    67: "float32",
    68: "float64",
}
REFUSED = {"pkl": "pickled objects are refused (unpickling runs code)"}


def mds_units(root: str, index: dict) -> list[Unit]:
    units = []
    first = None
    for i, shard in enumerate(index["shards"]):
        where = os.path.join(root, "index.json")
        if not isinstance(shard, dict) or shard.get("format") != "mds":
            raise BadSampleError(
                f"shard #{i} is not an MDS shard (format {shard.get('format')!r}); only MDS is read", source=where
            )
        cols = (tuple(shard["column_names"]), tuple(shard["column_encodings"]), tuple(shard["column_sizes"]))
        if first is None:
            first = cols
            for name, enc in zip(cols[0], cols[1]):
                _check_encoding(name, enc, where)
        elif cols != first:
            raise BadSampleError(f"shard #{i} has columns {cols[:2]}, shard #0 has {first[:2]}", source=where)
        stored = shard.get("zip_data") or shard["raw_data"]
        try:
            rel = safe_relpath(stored["basename"], f"shard #{i}")
        except FormatError as e:
            raise BadSampleError(str(e), source=where) from None
        n = int(shard["samples"])
        units.append(Unit("mds", root, 0, n, n, 0, max(int(shard["raw_data"]["bytes"]), 1), (rel,), shard))
    return units


def _check_encoding(name: str, enc: str, where: str) -> None:
    base = enc.split(":", 1)[0]
    if base in REFUSED:
        raise BadSampleError(f"column {name!r} ({enc}): {REFUSED[base]}", source=where)
    if enc in SCALARS | BINARY | {"str", "int", "str_int", "str_float", "json"} or base == "ndarray":
        return
    raise BadSampleError(
        f"column {name!r} has MDS encoding {enc!r}, which pack does not read "
        "(bytes, str, int, scalars, str_int, str_float, json, jpeg, png, 1-D ndarray)",
        source=where,
    )


_HASHES = {"xxh64": "xxh64", "xxh128": "xxh3_128", "xxh3_64": "xxh3_64", "xxh3_128": "xxh3_128", "xxh32": "xxh32"}


def _check_hashes(data: bytes, info: dict, path: str) -> None:
    if int(info.get("bytes", len(data))) != len(data):
        raise BadSampleError(f"shard is {len(data)} bytes, index.json says {info['bytes']}", source=path)
    for algo, want in (info.get("hashes") or {}).items():
        if algo in hashlib.algorithms_available:
            got = hashlib.new(algo, data).hexdigest()
        elif algo in _HASHES:
            import xxhash

            got = getattr(xxhash, _HASHES[algo])(data).hexdigest()
        else:
            continue  # an algorithm we cannot compute here; the size was checked
        if got != want:
            raise BadSampleError(f"{algo} hash {got} does not match index.json's {want}", source=path)


def _decompress(data: bytes, codec: str, path: str) -> bytes:
    algo = codec.split(":", 1)[0]
    try:
        if algo == "zstd":
            import zstandard

            return zstandard.ZstdDecompressor().decompress(data, max_output_size=1 << 34)
        if algo == "gz":
            import gzip

            return gzip.decompress(data)
        if algo == "bz2":
            import bz2

            return bz2.decompress(data)
        if algo == "br":
            # optional: only Brotli-compressed MDS needs it (imported by name: no stubs, maybe not installed)
            brotli = importlib.import_module("brotli")

            return brotli.decompress(data)
        if algo == "snappy":
            snappy = importlib.import_module("snappy")  # optional, as brotli

            return snappy.decompress(data)
    except ImportError as e:
        raise BadSampleError(f"{algo}-compressed shard needs the {e.name!r} package", source=path) from None
    except Exception as e:  # each codec has its own error class
        raise BadSampleError(f"cannot decompress ({type(e).__name__}: {e})", source=path) from None
    raise BadSampleError(f"unknown MDS compression {codec!r}", source=path)


def read_shard(unit: Unit) -> bytes:
    shard = unit.obj
    path = os.path.join(unit.path, unit.members[0])
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise BadSampleError(f"cannot read MDS shard ({e})", source=path) from None
    if shard.get("zip_data"):
        _check_hashes(data, shard["zip_data"], path)
        data = _decompress(data, shard["compression"], path)
        path += f" (decompressed {shard['raw_data']['basename']})"
    _check_hashes(data, shard["raw_data"], path)
    return data


def gather_ranges(buf: np.ndarray, starts: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The byte ranges [starts, starts + sizes) of ``buf``, concatenated, and their offsets (one
    copy of the bytes; no per-byte index array, which would cost 8 bytes per byte)."""
    offsets = np.zeros(len(sizes) + 1, np.int64)
    np.cumsum(sizes, out=offsets[1:])
    view = buf.data  # memoryview(buf): numpy's stubs give ndarray __buffer__ only from Python 3.12
    try:
        data = b"".join([view[a : a + n] for a, n in zip(starts.tolist(), sizes.tolist())])
    finally:
        view.release()
    return np.frombuffer(data, np.uint8), offsets


def mds_batches(unit: Unit) -> Iterator:
    import pyarrow as pa

    shard = unit.obj
    path = os.path.join(unit.path, unit.members[0])
    data = read_shard(unit)
    buf = np.frombuffer(data, np.uint8)
    n = int(np.frombuffer(data, np.uint32, 1)[0]) if len(data) >= 4 else -1
    if n != unit.count or len(data) < 4 * (n + 2):
        raise BadSampleError(f"shard holds {n} samples, index.json says {unit.count}", source=path)
    offsets = np.frombuffer(data, np.uint32, n + 1, 4).astype(np.int64)
    if n and (offsets[-1] > len(data) or np.any(np.diff(offsets) < 0)):
        raise BadSampleError("sample offsets run past the shard's end or backwards", source=path)
    names, encodings, sizes = shard["column_names"], shard["column_encodings"], shard["column_sizes"]
    var = [j for j, s in enumerate(sizes) if not s]
    starts = offsets[:-1]
    col_sizes = np.empty((n, len(names)), np.int64)
    for k, j in enumerate(var):
        col_sizes[:, j] = gather_ranges(buf, starts + 4 * k, np.full(n, 4, np.int64))[0].view(np.uint32)
    for j, s in enumerate(sizes):
        if s:
            col_sizes[:, j] = s
    col_starts = (
        starts[:, None]
        + 4 * len(var)
        + np.concatenate([np.zeros((n, 1), np.int64), np.cumsum(col_sizes, axis=1)[:, :-1]], axis=1)
    )
    if n and np.any(col_starts[:, -1] + col_sizes[:, -1] != offsets[1:]):
        bad = int(np.flatnonzero(col_starts[:, -1] + col_sizes[:, -1] != offsets[1:])[0])
        raise BadSampleError(f"sample {bad}: its column sizes do not add up to its byte range", source=path)
    arrays = []
    for j, (name, enc) in enumerate(zip(names, encodings)):
        values, voff = gather_ranges(buf, col_starts[:, j], col_sizes[:, j])
        arrays.append(_column(name, enc, values, voff, path))
    yield pa.RecordBatch.from_arrays(arrays, names)


def _column(name: str, enc: str, values: np.ndarray, voff: np.ndarray, path: str):
    import pyarrow as pa

    n = len(voff) - 1
    if enc in BINARY or enc == "str":
        arr = pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(voff.astype(np.int32)), pa.py_buffer(values)])
        if enc == "str":
            try:
                arr = arr.cast(pa.string())  # validates the UTF-8
            except pa.ArrowInvalid as e:
                raise BadSampleError(f"column {name!r} holds invalid UTF-8 ({e})", source=path) from None
        return arr
    if enc == "int":
        return pa.array(values.view(np.int64))
    if enc in SCALARS:
        return pa.array(values.view(np.dtype(enc)))
    if enc.startswith("ndarray"):
        fast = _ndarrays_1d(enc, values, voff)
        if fast is not None:
            return fast
    raw = [values[voff[i] : voff[i + 1]].tobytes() for i in range(n)]
    try:
        if enc == "str_int":
            return pa.array([int(x) for x in raw], type=pa.int64())
        if enc == "str_float":
            return pa.array([float(x) for x in raw], type=pa.float64())
        if enc == "json":
            return pa.array([json.loads(x) for x in raw])
    except (ValueError, pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise BadSampleError(f"column {name!r} ({enc}): {e}", source=path) from None
    return _ndarrays(name, enc, raw, path)


_SHAPE_DTYPES = {0: np.uint8, 1: np.uint16, 2: np.uint32, 3: np.uint64}


def _ndarrays_1d(enc: str, values: np.ndarray, voff: np.ndarray):
    """The common case, vectorised: every sample a 1-D array of one dtype with the same header
    layout. None when any sample differs (the per-sample path then reads or names it)."""
    import pyarrow as pa

    parts = enc.split(":")
    static_dtype = parts[1] if len(parts) > 1 and parts[1] else None
    if len(parts) > 2 or not len(voff) > 1:
        return None
    pos = voff[:-1].copy()
    if np.any(voff[1:] - pos < 2):
        return None
    if static_dtype is None:
        codes = values[pos]
        if np.any(codes != codes[0]) or int(codes[0]) not in NDARRAY_DTYPES:
            return None
        static_dtype = NDARRAY_DTYPES[int(codes[0])]
        pos += 1
    head = values[pos]
    if np.any(head != head[0]) or int(head[0]) >> 2 != 1:
        return None
    width = 1 << (int(head[0]) & 3)
    shape_at = pos + 1
    pos = shape_at + width
    dtype = np.dtype(static_dtype)
    sizes = voff[1:] - pos
    if np.any(sizes < 0) or np.any(sizes % dtype.itemsize):
        return None
    shape = gather_ranges(values, shape_at, np.full(len(pos), width, np.int64))[0].view(_SHAPE_DTYPES[int(head[0]) & 3])
    if not np.array_equal(shape.astype(np.int64), sizes // dtype.itemsize):
        return None
    data, offsets = gather_ranges(values, pos, sizes)
    if offsets[-1] // dtype.itemsize >= 1 << 31:
        return None
    return pa.ListArray.from_arrays(pa.array((offsets // dtype.itemsize).astype(np.int32)), pa.array(data.view(dtype)))


def _ndarrays(name: str, enc: str, raw: list[bytes], path: str):
    """1-D ``ndarray`` columns, of a fixed or per-sample dtype, as one list column."""
    import pyarrow as pa

    parts = enc.split(":")
    static_dtype = parts[1] if len(parts) > 1 and parts[1] else None
    static_shape = parts[2] if len(parts) > 2 else None
    arrays, dtype = [], None
    for i, b in enumerate(raw):
        pos = 0
        dt: str | None
        if static_dtype:
            dt = static_dtype
        else:
            dt = NDARRAY_DTYPES.get(b[0])
            pos = 1
        if static_shape is None:
            ndim, shape_code = b[pos] >> 2, b[pos] & 3
            pos += 1 + ndim * (1 << shape_code)
            if ndim != 1:
                raise BadSampleError(f"column {name!r}: sample {i} is a {ndim}-D array; fields are 1-D", source=path)
        elif "," in static_shape:
            raise BadSampleError(f"column {name!r}: fixed shape {static_shape} is not 1-D", source=path)
        if dt is None or (dtype is not None and dt != dtype):
            raise BadSampleError(f"column {name!r}: sample {i} has dtype {dt}, earlier ones {dtype}", source=path)
        dtype = dt
        arrays.append(np.frombuffer(b, np.dtype(dt), offset=pos))
    return pa.array(arrays, type=pa.list_(pa.from_numpy_dtype(np.dtype(dtype or "uint8"))))
