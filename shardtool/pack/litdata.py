"""A LitData ``optimize()`` output directory as a pack source, read from its documented chunk
format (litdata's ``streaming/writer.py`` and ``item_loader.PyTreeLoader``), without litdata:

    index.json: {"chunks": [{"filename", "chunk_size" (items), "chunk_bytes"}, ...],
                 "config": {"data_format": [serializer per leaf], "data_spec": pytree spec (JSON),
                            "compression": null | "zstd[:level]", "item_loader": "PyTreeLoader", ...}}
    chunk:      uint32 N, uint32 offsets[N + 1] (from the chunk's start), then per item a uint32
                size for every leaf and the leaves' bytes in order (anything after the last offset,
                such as an Arrow footer, is not read)

Leaves of a dict become fields of the same names (a single leaf: ``item``; a tuple or list of
leaves: ``item0``, ``item1``, ...). Serializers read: ``int`` (int64), ``float`` (float64),
``bool``, ``str``, ``bytes``, ``json``, 1-D ``numpy``/``no_header_numpy:N`` and
``tensor``/``no_header_tensor:N`` (kept as arrays of their dtype). Anything else — ``pickle``
(unpickling runs code), images, video — is an error naming the chunk and the serializer; so is
encryption or a per-sample/per-batch compression layout.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator

import numpy as np

from ..format.errors import BadSampleError, FormatError
from ..format.manifest import safe_relpath
from .mds import gather_ranges
from .workunit import Unit

# litdata.constants: _NUMPY_SCTYPES (index = the code in "no_header_numpy:N") and _TORCH_DTYPES_MAPPING
NUMPY_CODES = [
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
]
TORCH_CODES = {
    0: "float32",
    1: "float32",
    2: "float64",
    3: "float64",
    8: "float16",
    9: "float16",
    11: "uint8",
    12: "int8",
    13: "int16",
    14: "int16",
    15: "int32",
    16: "int32",
    17: "int64",
    18: "int64",
    19: "bool",
    20: "uint16",
}
SCALARS = {"int": "<i8", "float": "<f8", "bool": "?"}
FRAMED_MAGIC = b"LDFZ01\0\0"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def _field_names(spec_text, leaves: int, where: str) -> list[str]:
    try:
        spec = json.loads(spec_text)[1] if isinstance(spec_text, str) else spec_text[1]
    except (ValueError, TypeError, IndexError) as e:
        raise BadSampleError(f"unreadable data_spec ({e})", source=where) from None
    children = spec.get("children_spec") or []
    if spec.get("type") is None and leaves == 1:
        return ["item"]
    if any(c.get("children_spec") for c in children):
        raise BadSampleError("nested items (a dict or list inside the item) are not read; flatten them", source=where)
    if spec.get("type") in ("builtins.dict", "collections.OrderedDict"):
        names = json.loads(spec["context"])
    elif spec.get("type") in ("builtins.tuple", "builtins.list"):
        names = [f"item{i}" for i in range(len(children))]
    else:
        raise BadSampleError(f"items of type {spec.get('type')} are not read", source=where)
    if len(names) != leaves:
        raise BadSampleError(f"data_spec names {len(names)} leaves, data_format {leaves}", source=where)
    return [str(n) for n in names]


def _check_serializer(fmt: str, name: str, where: str) -> None:
    base = fmt.split(":", 1)[0]
    if (
        fmt in SCALARS
        or fmt in ("str", "bytes", "json", "numpy", "tensor")
        or base in ("no_header_numpy", "no_header_tensor")
    ):
        return
    why = (
        "unpickling runs code"
        if base == "pickle"
        else "pack reads int, float, bool, str, bytes, json, 1-D numpy/tensor"
    )
    raise BadSampleError(f"leaf {name!r} has serializer {fmt!r}: not read ({why})", source=where)


def litdata_units(root: str, index: dict) -> list[Unit]:
    where = os.path.join(root, "index.json")
    config = index["config"]
    if config.get("encryption"):
        raise BadSampleError("encrypted chunks are not read", source=where)
    compression = config.get("compression")
    level = config.get("compression_level") or ("chunk" if compression else None)
    if compression and (not str(compression).startswith("zstd") or level not in ("chunk", "batch", "sample")):
        raise BadSampleError(
            f"compression {compression!r} at level {level!r} is not read (zstd: chunk, batch or sample)", source=where
        )
    formats = list(config.get("data_format") or [])
    names = _field_names(config.get("data_spec"), len(formats), where)
    for fmt, name in zip(formats, names):
        _check_serializer(fmt, name, where)
    units = []
    for i, chunk in enumerate(index["chunks"]):
        try:
            rel = safe_relpath(chunk["filename"], f"chunk #{i}")
        except (FormatError, KeyError) as e:
            raise BadSampleError(str(e), source=where) from None
        n = int(chunk["chunk_size"])
        units.append(
            Unit(
                "litdata",
                root,
                0,
                n,
                n,
                0,
                max(int(chunk.get("chunk_bytes") or 1), 1),
                (rel,),
                {"formats": formats, "names": names, "compression": compression and level},
            )
        )
    return units


def read_chunk(unit: Unit) -> bytes:
    path = os.path.join(unit.path, unit.members[0])
    if path.endswith(".zstd.bin") and not os.path.exists(path) and os.path.exists(path[:-9] + ".bin"):
        path = path[:-9] + ".bin"  # litdata's own reader inflates a local whole-file chunk in place
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise BadSampleError(f"cannot read LitData chunk ({e})", source=path) from None
    level = unit.obj["compression"]
    if not level or (level == "chunk" and data[:4] != ZSTD_MAGIC):
        return data
    import zstandard

    def inflate(b) -> bytes:
        return zstandard.ZstdDecompressor().decompress(b, max_output_size=1 << 34)

    try:
        if level == "chunk":  # the whole file is one zstd stream
            return inflate(data)
        if level == "batch":  # litdata's framed layout (streaming/framed_zstd.py), made classic again
            magic, _, _, n, _, frames = struct.unpack_from("<8sHHIII", data, 0)
            if magic != FRAMED_MAGIC:
                raise BadSampleError("not a framed zstd chunk (bad magic)", source=path)
            offsets = np.frombuffer(data, np.uint32, n + 1, 24).astype(np.int64)
            table = 24 + 4 * (n + 1)
            body = b"".join(
                inflate(data[off : off + clen])
                for _, _, off, clen, _ in (struct.unpack_from("<IIQII", data, table + 24 * f) for f in range(frames))
            )
        else:  # "sample": the classic layout, each item its own zstd frame
            n = struct.unpack_from("<I", data, 0)[0]
            offsets = np.frombuffer(data, np.uint32, n + 1, 4).astype(np.int64)
            parts = [inflate(data[offsets[i] : offsets[i + 1]]) for i in range(n)]
            body = b"".join(parts)
            offsets = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)
    except (zstandard.ZstdError, struct.error, ValueError) as e:
        raise BadSampleError(f"cannot decompress ({type(e).__name__}: {e})", source=path) from None
    if len(body) != int(offsets[-1] - offsets[0]):
        raise BadSampleError(
            f"decompressed items are {len(body)} bytes, the chunk's offsets say {int(offsets[-1] - offsets[0])}",
            source=path,
        )
    header = 4 + 4 * (n + 1)
    return struct.pack("<I", n) + (offsets - offsets[0] + header).astype(np.uint32).tobytes() + body


def litdata_batches(unit: Unit) -> Iterator:
    import pyarrow as pa

    path = os.path.join(unit.path, unit.members[0])
    data = read_chunk(unit)
    buf = np.frombuffer(data, np.uint8)
    n = int(np.frombuffer(data, np.uint32, 1)[0]) if len(data) >= 4 else -1
    if n != unit.count or len(data) < 4 * (n + 2):
        raise BadSampleError(f"chunk holds {n} items, index.json says {unit.count}", source=path)
    offsets = np.frombuffer(data, np.uint32, n + 1, 4).astype(np.int64)
    if n and (offsets[-1] > len(data) or np.any(np.diff(offsets) <= 0)):
        raise BadSampleError(
            "item offsets run past the chunk's end, or an item is empty (a layout not read: Arrow-only chunks)",
            source=path,
        )
    formats, names = unit.obj["formats"], unit.obj["names"]
    k = len(formats)
    starts = offsets[:-1]
    head, _ = gather_ranges(buf, np.repeat(starts, 1), np.full(n, 4 * k, np.int64))
    sizes = head.view(np.uint32).reshape(n, k).astype(np.int64)
    col_starts = (
        starts[:, None] + 4 * k + np.concatenate([np.zeros((n, 1), np.int64), np.cumsum(sizes, axis=1)[:, :-1]], axis=1)
    )
    ends = col_starts[:, -1] + sizes[:, -1]
    if n and np.any(ends != offsets[1:]):
        bad = int(np.flatnonzero(ends != offsets[1:])[0])
        raise BadSampleError(f"item {bad}: its leaf sizes do not add up to its byte range", source=path)
    arrays = []
    for j, (name, fmt) in enumerate(zip(names, formats)):
        values, voff = gather_ranges(buf, col_starts[:, j], sizes[:, j])
        arrays.append(_leaves(name, fmt, values, voff, f"{path} leaf {name!r}"))
    yield pa.RecordBatch.from_arrays(arrays, names)


def _leaves(name: str, fmt: str, values: np.ndarray, voff: np.ndarray, where: str):
    import pyarrow as pa

    n = len(voff) - 1
    if fmt in ("str", "bytes"):
        arr = pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(voff.astype(np.int32)), pa.py_buffer(values)])
        if fmt == "str":
            try:
                arr = arr.cast(pa.string())
            except pa.ArrowInvalid as e:
                raise BadSampleError(f"invalid UTF-8 ({e})", source=where) from None
        return arr
    if fmt in SCALARS:
        dtype = np.dtype(SCALARS[fmt])
        if np.any(np.diff(voff) != dtype.itemsize):
            raise BadSampleError(f"{fmt} leaves must be {dtype.itemsize} bytes", source=where)
        return pa.array(values.view(dtype))
    base, _, code = fmt.partition(":")
    if base in ("no_header_numpy", "no_header_tensor") and np.all(voff < 1 << 31):
        table = NUMPY_CODES if base == "no_header_numpy" else TORCH_CODES
        try:
            dtype = np.dtype(table[int(code)])
        except (ValueError, KeyError, IndexError):
            raise BadSampleError(f"unknown dtype code in {fmt!r}", source=where) from None
        if np.any(voff % dtype.itemsize):
            raise BadSampleError(f"leaf sizes are not whole {dtype} elements", source=where)
        # the leaves' bytes are the values: one list column over them, no per-item work
        return pa.ListArray.from_arrays(
            pa.array((voff // dtype.itemsize).astype(np.int32)), pa.array(values.view(dtype))
        )
    raw = [values[voff[i] : voff[i + 1]].tobytes() for i in range(n)]
    if fmt == "json":
        try:
            return pa.array([json.loads(x) for x in raw])
        except (ValueError, pa.ArrowInvalid, pa.ArrowTypeError) as e:
            raise BadSampleError(f"json: {e}", source=where) from None
    if base in ("no_header_numpy", "no_header_tensor"):
        table = NUMPY_CODES if base == "no_header_numpy" else TORCH_CODES
        try:
            dtype = np.dtype(table[int(code)])
        except (ValueError, KeyError, IndexError):
            raise BadSampleError(f"unknown dtype code in {fmt!r}", source=where) from None
        arrays = [np.frombuffer(x, dtype) for x in raw]
    else:  # numpy / tensor: each leaf carries its dtype and shape
        arrays, leaf_dtype = [], None
        for i, x in enumerate(raw):
            if fmt == "numpy":
                code_i, ndim = struct.unpack_from("<II", x)
                dt, shape_fmt = (NUMPY_CODES[code_i] if code_i < len(NUMPY_CODES) else None), "<%dI"
            else:
                code_i, ndim = struct.unpack_from(">II", x)
                dt, shape_fmt = TORCH_CODES.get(code_i), ">%dI"
            shape = struct.unpack_from(shape_fmt % ndim, x, 8)
            if dt is None or ndim != 1 or (leaf_dtype is not None and dt != leaf_dtype):
                raise BadSampleError(
                    f"item {i}: a {ndim}-D {dt} array; fields are 1-D arrays of one dtype", source=where
                )
            leaf_dtype = dt
            arrays.append(np.frombuffer(x, np.dtype(dt), shape[0], 8 + 4 * ndim))
        dtype = np.dtype(leaf_dtype or "uint8")
    return pa.array(arrays, type=pa.list_(pa.from_numpy_dtype(dtype)))
