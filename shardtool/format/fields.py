"""Fields of a sample: how each is stored in a tar member or an Arrow column, and decoded.

A field has a *storage* (what Python value the packer holds) and an *encoding* (how its bytes
are decoded). Sources that already hold encoded bytes (file trees, tar shards, binary columns)
use storage ``raw`` and keep their bytes untouched, so webdataset reads them back unmodified.
"""

from __future__ import annotations

import ast
import io
import json
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .errors import FormatError, PickleRefusedError

STORAGES = ("raw", "array", "text", "int", "json")
# Member extensions whose bytes we know how to decode; anything else decodes to bytes.
_ENCODING_BY_EXT = {
    "npy": "npy",
    "json": "json",
    "jsn": "json",
    "txt": "txt",
    "text": "txt",
    "cls": "cls",
    "cls2": "cls",
    "index": "cls",
    "inx": "cls",
    "id": "cls",
    "pyd": "pickle",
    "pickle": "pickle",
    "pkl": "pickle",
}
_ENCODING_OF_STORAGE = {"array": "npy", "text": "txt", "int": "cls", "json": "json"}


def encoding_for_ext(ext: str) -> str:
    return _ENCODING_BY_EXT.get(ext.rsplit(".", 1)[-1].lower(), "bytes")


@dataclass(frozen=True)
class FieldSpec:
    name: str
    ext: str
    encoding: str
    storage: str
    dtype: str | None = None

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, d: dict) -> FieldSpec:
        spec = cls(d["name"], d["ext"], d["encoding"], d["storage"], d.get("dtype"))
        if spec.storage not in STORAGES:
            raise FormatError(f"field {spec.name!r}: unknown storage {spec.storage!r}")
        return spec

    @classmethod
    def raw(cls, ext: str) -> FieldSpec:
        """A field whose bytes are already encoded (file trees, tar members): name = extension."""
        return cls(ext, ext, encoding_for_ext(ext), "raw")


def _ext_for(name: str, encoding: str) -> str:
    # "text" holding str -> "text.txt", but "txt" -> "txt": never double the extension.
    return name if encoding_for_ext(name) == encoding else f"{name}.{encoding}"


def storage_of(value: Any) -> tuple[str, str | None]:
    """The storage a structured-source value needs (JSONL / Parquet), and its dtype if an array."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "raw", None
    if isinstance(value, str):
        return "text", None
    if isinstance(value, bool):
        return "json", None
    if isinstance(value, (int, np.integer)):
        return "int", None
    if isinstance(value, np.ndarray):
        if value.dtype == object or value.ndim != 1:
            return "json", None
        return "array", value.dtype.str.lstrip("<>=|")
    if (
        isinstance(value, list)
        and value
        and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value)
    ):
        return "array", "i8"
    return "json", None


def infer_field(name: str, value: Any) -> FieldSpec:
    storage, dtype = storage_of(value)
    if storage == "raw":
        return FieldSpec.raw(name)
    encoding = _ENCODING_OF_STORAGE[storage]
    return FieldSpec(name, _ext_for(name, encoding), encoding, storage, dtype)


def as_array(spec: FieldSpec, value: Any) -> np.ndarray:
    arr = np.asarray(value, dtype=np.dtype(spec.dtype)) if spec.dtype else np.asarray(value)
    if arr.ndim != 1:
        raise ValueError(f"field {spec.name!r} must be a 1-D array, got shape {arr.shape}")
    return arr


# ---------------------------------------------------------------- npy, fast and pickle-free
_NPY_MAGIC = b"\x93NUMPY\x01\x00"
_npy_header_cache: dict[tuple, bytes] = {}
_npy_parse_cache: dict[bytes, tuple[np.dtype, tuple, bool]] = {}


def _npy_header_of(dtype: np.dtype, shape: tuple) -> bytes:
    """What ``np.save`` writes before a C-contiguous array's data, cached by (dtype, shape)."""
    key = (dtype.str, shape)
    header = _npy_header_cache.get(key)
    if header is None:
        buf = io.BytesIO()
        np.lib.format.write_array_header_1_0(
            buf, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
        )
        header = buf.getvalue()
        if len(_npy_header_cache) < 65536:
            _npy_header_cache[key] = header
    return header


def npy_header(dtype: np.dtype, n: int) -> bytes:
    """The npy (format 1.0) header of a 1-D array of ``n`` elements of ``dtype``: ``npy_header(a.dtype,
    len(a)) + a.tobytes() == npy_bytes(a)``."""
    return _npy_header_of(dtype, (int(n),))


def npy_bytes(arr: np.ndarray) -> bytes:
    """The exact bytes ``np.save`` writes for a 1-D array (format 1.0), without its overhead."""
    arr = np.ascontiguousarray(arr)
    return _npy_header_of(arr.dtype, arr.shape) + arr.tobytes()


def npy_layout(head: bytes | memoryview) -> tuple[np.dtype, tuple, bool, int]:
    """(dtype, shape, fortran_order, data offset) from the first bytes of an npy payload (at
    least its header), without ever unpickling (object arrays are refused)."""
    mv = memoryview(head)
    if bytes(mv[:6]) != b"\x93NUMPY":
        raise ValueError("not an npy payload")
    major = mv[6]
    if major == 1:
        hlen = int.from_bytes(mv[8:10], "little")
        start = 10
    else:
        hlen = int.from_bytes(mv[8:12], "little")
        start = 12
    if len(mv) < start + hlen:
        raise ValueError("npy header is cut short")
    header = bytes(mv[start : start + hlen])
    parsed = _npy_parse_cache.get(header)
    if parsed is None:
        d = ast.literal_eval(header.decode("latin1"))
        dtype = np.dtype(d["descr"])
        if dtype.hasobject:
            raise PickleRefusedError("npy payload holds Python objects (would need unpickling)")
        parsed = (dtype, tuple(d["shape"]), bool(d["fortran_order"]))
        if len(_npy_parse_cache) < 65536:
            _npy_parse_cache[header] = parsed
    return (*parsed, start + hlen)


def npy_decode(data: bytes | memoryview) -> np.ndarray:
    """Parse npy bytes without ever unpickling (object arrays are refused)."""
    dtype, shape, fortran, offset = npy_layout(data)
    count = int(np.prod(shape)) if shape else 1
    arr = np.frombuffer(memoryview(data), dtype=dtype, count=count, offset=offset)
    return arr.reshape(shape, order="F" if fortran else "C")


# ---------------------------------------------------------------- encode / decode
def encode(spec: FieldSpec, value: Any) -> bytes:
    """Bytes of a tar member for ``value``."""
    s = spec.storage
    if s == "raw":
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError(f"field {spec.name!r} holds bytes, got {type(value).__name__}")
        return bytes(value)
    if s == "array":
        return npy_bytes(as_array(spec, value))
    if s == "text":
        return value.encode("utf-8")
    if s == "int":
        return str(int(value)).encode("ascii")
    return json_text(value).encode()


def json_text(value: Any) -> str:
    """The canonical JSON text of a value (compact, sorted keys, UTF-8 kept): JSON fields in tar
    members and Arrow columns alike."""
    return json.dumps(to_jsonable(value), separators=(",", ":"), ensure_ascii=False, sort_keys=True)


def to_jsonable(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, (bytes, bytearray)):
        raise TypeError("bytes inside a JSON field cannot be stored")
    return value


def decode_bytes(encoding: str, data: bytes | memoryview, *, allow_pickle: bool = False, what: str = "") -> Any:
    """Decode a member's bytes by its encoding. Pickle is refused unless explicitly allowed."""
    if encoding == "npy":
        return npy_decode(data)
    if encoding == "json":
        return json.loads(bytes(data))
    if encoding == "txt":
        return bytes(data).decode("utf-8")
    if encoding == "cls":
        return int(bytes(data))
    if encoding == "pickle":
        if not allow_pickle:
            raise PickleRefusedError(
                f"{what or 'field'} is pickled; refusing to unpickle data from a shard "
                "(pass allow_pickle=True only for data you trust)"
            )
        import pickle

        return pickle.loads(bytes(data))
    return bytes(data)


def length_of(spec: FieldSpec, value: Any, *, allow_pickle: bool = False) -> int:
    """The length of a sample as defined by one field: len() of the value, or the int itself."""
    if spec.storage == "raw":
        value = decode_bytes(spec.encoding, value, allow_pickle=allow_pickle, what=f"field {spec.name!r}")
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"length field {spec.name!r} is a boolean, not a length")
    if isinstance(value, (int, np.integer)):
        n = int(value)
    elif isinstance(value, (list, tuple, str, bytes, bytearray, np.ndarray, dict)):
        n = len(value)
    elif isinstance(value, float) and value.is_integer():
        n = int(value)
    else:
        raise ValueError(f"length field {spec.name!r} holds {type(value).__name__}, which has no length")
    if n < 0:
        raise ValueError(f"length field {spec.name!r} is negative ({n})")
    return n
