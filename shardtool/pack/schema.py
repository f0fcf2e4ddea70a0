"""From a source record to a packable sample: field set, storage conversion, key, length.

The dataset's fields are inferred once, from the first sample of the first unit, by every
task and worker alike, so all shards agree whatever the split. Every later sample is checked
against them; anything that does not fit is a :class:`BadSampleError` naming where it came from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..format.arrowshard import KEY_COLUMN
from ..format.errors import BadSampleError, FormatError, ShardtoolError
from ..format.fields import FieldSpec, encode, infer_field, length_of, npy_header
from ..format.keys import is_control, key_problem

_RESERVED = {KEY_COLUMN}


def field_name_problem(name: str) -> str | None:
    if not isinstance(name, str) or not name:
        return "empty field name"
    if "/" in name or "\\" in name or ".." in name or name.startswith(".") or any(is_control(c) for c in name):
        return f"field name {name!r} cannot be part of a tar member name"
    if name.startswith("__") and name.endswith("__"):
        return f"field name {name!r} is reserved"
    return None


def infer_fields(
    kind: str, obj: dict[str, Any], *, source: str, where: str, key_field: str | None = None
) -> list[FieldSpec]:
    """Fields of the dataset from its first sample (file trees / tars: one raw field per extension).
    The ``key_field`` column is the key, not also a field."""
    if kind in ("tree", "tar", "images"):
        return [FieldSpec.raw(ext) for ext in sorted(obj)]
    if key_field is not None and key_field not in obj:
        raise BadSampleError(f"missing key field {key_field!r}", source=source, position=where)
    specs = []
    for name, value in obj.items():
        if name in _RESERVED or name == key_field:
            continue
        problem = field_name_problem(name)
        if problem:
            raise BadSampleError(problem, source=source, position=where)
        specs.append(infer_field(name, value))
    if not specs:
        raise BadSampleError("first sample has no fields", source=source, position=where)
    return specs


class Shaper:
    """Turns a reader's record into (key, payloads, values, length) for the shard writer."""

    def __init__(
        self,
        fields: list[FieldSpec],
        *,
        key_field: str | None,
        length_field: str | None,
        length_fn: Callable | None,
        key_width: int,
        max_length: int | None = None,
        truncate: bool = False,
    ):
        self.fields = fields
        self.names = [f.name for f in fields]
        self.name_set = set(self.names)
        self.key_field = key_field
        self.length_field = length_field
        self.length_idx = self.names.index(length_field) if length_field else -1
        self.length_fn = length_fn
        self.key_width = key_width
        self.codecs = [_codec(f) for f in fields]
        self.nfields = len(fields)
        spec = fields[self.length_idx] if self.length_idx >= 0 else None
        # Lengths of arrays and strings are len(); only other storages go through length_of.
        self.len_direct = spec is not None and spec.storage in ("array", "text")
        # --max-length: a longer sample is dropped (shape returns None) or, with truncate, its
        # length field's array is cut to max_length elements (was_truncated says so).
        self.max_length = max_length
        self.truncate = truncate
        self.was_truncated = False
        self.field_hint = ""  # appended to a field-set mismatch (the worker sets it per source kind)
        self.key_from_data = False  # the last key came from the sample (a name or a column), not its position
        self.not_fields = {KEY_COLUMN} | ({key_field} if key_field else set())

    def key_of(self, position: int, key: str | None, obj: dict[str, Any], source: str, where: str) -> str:
        self.key_from_data = True
        if key is None:
            if self.key_field is not None:
                if self.key_field not in obj:
                    raise BadSampleError(f"missing key field {self.key_field!r}", source=source, position=where)
                key = obj[self.key_field]
                if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
                    key = str(int(key))
                elif isinstance(key, bytes):
                    try:
                        key = key.decode("utf-8")
                    except UnicodeDecodeError:
                        raise BadSampleError("key is not valid UTF-8", source=source, position=where) from None
            elif KEY_COLUMN in obj:
                key = obj[KEY_COLUMN]
            else:
                self.key_from_data = False
                return f"{position:0{self.key_width}d}"
        problem = key_problem(key)
        if problem:
            raise BadSampleError(problem, source=source, position=where)
        return key

    def shape(self, position: int, key: str | None, obj: dict[str, Any], source: str, where: str):
        key = self.key_of(position, key, obj, source, where)
        keys = obj.keys()
        if keys != self.name_set and keys - self.not_fields != self.name_set:
            if self.length_field and self.length_field not in obj:
                raise BadSampleError(f"missing length field {self.length_field!r}", source=source, position=where)
            got = sorted(k for k in obj if k not in self.not_fields)
            raise BadSampleError(
                f"sample {key!r} has fields {got}, the dataset has {sorted(self.names)}" + self.field_hint,
                source=source,
                position=where,
            )
        values = []
        payloads = []
        nbytes = 0
        try:
            for name, codec in zip(self.names, self.codecs):
                v, p = codec(obj[name])
                values.append(v)
                payloads.append(p)
                nbytes += len(p)
        except (TypeError, ValueError, OverflowError) as e:
            raise BadSampleError(f"field {name!r}: {e}", source=source, position=where) from None
        if self.len_direct:
            length = len(values[self.length_idx])
        else:
            length = self.length(key, values, nbytes, source, where)
        self.was_truncated = False
        if self.max_length is not None and length > self.max_length:
            if not self.truncate:
                return None
            # Per-token fields (arrays as long as the tokens: a loss mask, stored labels) are cut
            # with them, or packing would find them misaligned.
            full = len(values[self.length_idx])
            for i, spec in enumerate(self.fields):
                if i == self.length_idx or (spec.storage == "array" and len(values[i]) == full):
                    values[i], payload = self.codecs[i](values[i][: self.max_length])
                    nbytes += len(payload) - len(payloads[i])
                    payloads[i] = payload
            length = self.max_length
            self.was_truncated = True
        return key, values, payloads, length, nbytes

    def length(self, key: str, values: list, nbytes: int, source: str, where: str) -> int:
        if self.length_idx >= 0:
            try:
                return length_of(self.fields[self.length_idx], values[self.length_idx])
            except (ValueError, TypeError, FormatError) as e:  # FormatError: a pickled field, refused
                raise BadSampleError(f"bad length: {e}", source=source, position=where) from None
        if self.length_fn is not None:
            sample = {KEY_COLUMN: key, **dict(zip(self.names, values))}
            try:
                n = self.length_fn(sample)
            except (KeyboardInterrupt, MemoryError, SystemExit):
                raise
            except Exception as e:
                raise BadSampleError(
                    f"length function failed ({type(e).__name__}: {e})", source=source, position=where
                ) from None
            if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)):
                raise BadSampleError(
                    f"length function returned {type(n).__name__} {n!r}, not an integer", source=source, position=where
                )
            if n < 0:
                raise BadSampleError(f"length function returned a negative length ({n})", source=source, position=where)
            return int(n)
        return nbytes


def _codec(spec: FieldSpec) -> Callable[[Any], tuple[Any, bytes]]:
    """value → (stored value, tar payload bytes) for one field; the packer's per-sample hot path."""
    if spec.storage == "array":
        dtype = np.dtype(spec.dtype)
        headers: dict[int, bytes] = {}

        def conv_array(v):
            if isinstance(v, np.ndarray):
                if v.ndim == 1 and np.can_cast(v.dtype, dtype, "safe"):
                    return v.astype(dtype)
                raise TypeError(f"array of {v.dtype} {v.shape} does not fit the dataset's 1-D {dtype}")
            if isinstance(v, list):
                if not v:
                    return np.zeros(0, dtype)
                arr = np.asarray(v)
                if arr.ndim != 1 or arr.dtype.kind not in "iu" or not np.can_cast(arr.dtype, dtype, "same_kind"):
                    raise TypeError(f"expected a list of integers, got {_describe(v)}")
                return arr.astype(dtype, copy=False)
            raise TypeError(f"expected an array, got {type(v).__name__}")

        def enc_array(v):
            if v.__class__ is not np.ndarray or v.dtype != dtype or v.ndim != 1:
                v = conv_array(v)
            h = headers.get(v.shape[0])
            if h is None:
                h = npy_header(v.dtype, v.shape[0])
                if len(headers) < 65536:
                    headers[v.shape[0]] = h
            return v, h + v.tobytes()

        return enc_array
    if spec.storage == "text":

        def enc_text(v):
            if not isinstance(v, str):
                raise TypeError(f"expected a string, got {type(v).__name__}")
            return v, v.encode("utf-8")

        return enc_text
    if spec.storage == "int":

        def enc_int(v):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"expected an integer, got {type(v).__name__}")
            v = int(v)
            return v, str(v).encode("ascii")

        return enc_int
    if spec.storage == "raw":

        def enc_raw(v):
            if not isinstance(v, (bytes, bytearray, memoryview)):
                raise TypeError(f"expected bytes, got {type(v).__name__}")
            return v, bytes(v)

        return enc_raw
    return lambda v: (v, encode(spec, v))


def _describe(v: list) -> str:
    kinds = sorted({type(x).__name__ for x in v[:1000]})
    return f"a list of {', '.join(kinds)}"


def check_length_option(fields: list[FieldSpec], length_field: str | None) -> None:
    if length_field is not None and length_field not in [f.name for f in fields]:
        raise ShardtoolError(
            f"--length {length_field!r} is not a field of the samples (fields: {', '.join(f.name for f in fields)})"
        )


MAX_LENGTH_POLICIES = ("drop", "truncate")


def check_max_length_option(
    fields: list[FieldSpec], length_field: str | None, max_length: int | None, policy: str
) -> bool:
    """Validate --max-length / --max-length-policy; True when over-long samples are truncated."""
    if policy not in MAX_LENGTH_POLICIES:
        raise ShardtoolError(f"--max-length-policy must be one of {', '.join(MAX_LENGTH_POLICIES)}, got {policy!r}")
    if max_length is None:
        return False
    if isinstance(max_length, bool) or not isinstance(max_length, (int, np.integer)) or max_length < 1:
        raise ShardtoolError(f"--max-length must be an integer ≥ 1, got {max_length!r}")
    if policy != "truncate":
        return False
    spec = next((f for f in fields if f.name == length_field), None)
    if spec is None or spec.storage != "array":
        what = (
            f"--length {length_field!r} is stored as {spec.storage}"
            if spec is not None
            else "the length is not a field (payload bytes or --length-fn)"
        )
        raise ShardtoolError(
            f"--max-length-policy truncate cuts the --length field's array to --max-length "
            f"elements, so it needs --length naming a 1-D array field; {what}. "
            "Use --max-length-policy drop to skip over-long samples instead"
        )
    return True
