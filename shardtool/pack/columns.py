"""Whole record batches → shard batches: keys, fields in the shard's Arrow types, lengths, sizes.

This is the packer's norm for every structured source (Parquet, Arrow, tables, datasets, and
dicts gathered into batches): one record batch of the source becomes one :class:`ShardBatch`
with vectorised work only — no Python per sample except for JSON-stored fields, whose canonical
text is made by Python's json. Tar shards then lay out members from it (``fastcol``), Arrow
shards write it (re-cut into small record batches by the shard writer).

:meth:`ColumnShaper.shape` returns ``None`` for a batch it cannot convert exactly as the
per-sample path (``schema.Shaper``) would — nulls, unexpected types or columns, bad keys, a length
that needs decoding, over-long samples to truncate — and the caller packs that batch sample by
sample, which also produces the errors naming the bad row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.types as pt

from ..format.arrowshard import KEY_COLUMN, arrow_type, schema_for
from ..format.fields import FieldSpec, json_text, npy_header
from ..format.sindex import bad_keys


@dataclass
class ShardBatch:
    batch: pa.RecordBatch  # schema_for(fields): __key__, then the fields
    lengths: np.ndarray  # (n,) int64
    sizes: np.ndarray  # (n, F) int64: each field's payload bytes as a tar member
    keys_from_data: bool  # keys came from a column (so they may repeat), not from positions

    def __len__(self) -> int:
        return self.batch.num_rows

    def filter(self, keep: np.ndarray) -> ShardBatch:
        return ShardBatch(self.batch.filter(pa.array(keep)), self.lengths[keep], self.sizes[keep], self.keys_from_data)


def position_keys(positions: np.ndarray, width: int) -> pa.Array:
    """``f"{p:0{width}d}"`` for every position, built as one buffer of digits."""
    positions = np.asarray(positions, dtype=np.int64)
    n = len(positions)
    if n and (int(positions.max()) >= 10**width or int(positions.min()) < 0):
        return pa.array([f"{int(p):0{width}d}" for p in positions], type=pa.string())
    powers = 10 ** np.arange(width - 1, -1, -1, dtype=np.int64)
    digits = (positions[:, None] // powers) % 10 + 48
    data = pa.py_buffer(digits.astype(np.uint8).tobytes())
    offsets = pa.py_buffer((np.arange(n + 1, dtype=np.int32) * width).tobytes())
    return pa.StringArray.from_buffers(n, offsets, data)


_NPY_HEADER_LEN: dict[str, np.ndarray] = {}


def npy_header_lengths(dtype: np.dtype, counts: np.ndarray) -> np.ndarray:
    """Length of the npy header of a 1-D array of each count (it depends on the digit count only)."""
    table = _NPY_HEADER_LEN.get(dtype.str)
    if table is None:
        table = np.array([len(npy_header(dtype, 10**d)) for d in range(19)], dtype=np.int64)
        _NPY_HEADER_LEN[dtype.str] = table
    ndigits = np.searchsorted(10 ** np.arange(1, 19, dtype=np.int64), counts, side="right")
    return table[ndigits]


def _flat_values(col) -> pa.Array:
    return col.flatten()  # the values of a (possibly sliced) list array, only its rows'


def _array_field(spec: FieldSpec, col):
    t = col.type
    if not (pt.is_list(t) or pt.is_large_list(t)):
        return None
    vt = t.value_type
    if not (pt.is_integer(vt) or pt.is_floating(vt)) or _flat_values(col).null_count:
        return None
    dtype = np.dtype(spec.dtype)
    # The per-sample path accepts only casts numpy calls safe (never float → int, never narrowing).
    if not np.can_cast(np.dtype(vt.to_pandas_dtype()), dtype, "safe"):
        return None
    target = arrow_type(spec)
    if t != target:
        col = col.cast(target)
    counts = np.diff(col.offsets.to_numpy()).astype(np.int64)
    sizes = npy_header_lengths(dtype, counts) + counts * dtype.itemsize
    return col, sizes, counts


def _text_field(spec: FieldSpec, col, want_length: bool):
    if not (pt.is_string(col.type) or pt.is_large_string(col.type)):
        return None
    try:  # invalid UTF-8 must fail as the per-sample path fails (it decodes every string)
        col.validate(full=True)
    except pa.ArrowInvalid:
        return None
    if col.type != pa.string():
        col = col.cast(pa.string())
    sizes = pc.binary_length(col).to_numpy().astype(np.int64)
    lengths = pc.utf8_length(col).to_numpy().astype(np.int64) if want_length else None
    return col, sizes, lengths


def _int_field(col):
    if not pt.is_integer(col.type):
        return None
    try:
        col = col.cast(pa.int64())
    except pa.ArrowInvalid:  # a uint64 past int64
        return None
    sizes = pc.binary_length(pc.cast(col, pa.string())).to_numpy().astype(np.int64)
    return col, sizes, col.to_numpy()


def _raw_field(spec: FieldSpec, col, want_length: bool):
    if not (pt.is_binary(col.type) or pt.is_large_binary(col.type)):
        return None
    if want_length and spec.encoding != "bytes":
        return None  # its length is that of the decoded value: the per-sample path decodes it
    if col.type != pa.binary():
        col = col.cast(pa.binary())
    sizes = pc.binary_length(col).to_numpy().astype(np.int64)
    return col, sizes, sizes


def _json_field(col, is_text: bool):
    if is_text:  # made by dicts_to_batch: already the canonical JSON text
        return col, pc.binary_length(col).to_numpy().astype(np.int64), None
    texts = pa.array([json_text(v) for v in col.to_pylist()], type=pa.string())
    return texts, pc.binary_length(texts).to_numpy().astype(np.int64), None


def string_keys(col) -> pa.Array | None:
    """A key column as UTF-8 strings (integers in decimal, as ``str(int)``), or None if it cannot be."""
    t = col.type
    try:
        if pt.is_integer(t):
            return pc.cast(col, pa.string())
        if pt.is_string(t) or pt.is_large_string(t) or pt.is_binary(t) or pt.is_large_binary(t):
            return col.cast(pa.string())  # binary → string validates UTF-8
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None
    return None


class ColumnShaper:
    """Shapes record batches for one pack job's fields (see the module docstring)."""

    def __init__(
        self,
        fields: list[FieldSpec],
        *,
        key_field: str | None,
        length_field: str | None,
        key_width: int,
        max_length: int | None = None,
        truncate: bool = False,
    ):
        self.fields = fields
        self.names = [f.name for f in fields]
        self.schema = schema_for(fields)
        self.key_field = key_field
        self.length_field = length_field
        self.key_width = key_width
        self.max_length = max_length
        self.truncate = truncate  # over-long samples are cut: the per-sample path does that
        self.dropped = 0  # samples over max_length, dropped by the last shape() call

    def _keys(self, batch: pa.RecordBatch, positions: np.ndarray) -> tuple[pa.Array | None, bool]:
        names = batch.schema.names
        column = self.key_field if self.key_field is not None else (KEY_COLUMN if KEY_COLUMN in names else None)
        if column is None:
            return position_keys(positions, self.key_width), False
        if column not in names:
            return None, True
        keys = string_keys(batch.column(names.index(column)))
        if keys is None or keys.null_count or bad_keys(keys) is not None:
            return None, True
        return keys, True

    def shape(self, batch: pa.RecordBatch, positions: np.ndarray, *, json_as_text: bool = False) -> ShardBatch | None:
        """``json_as_text``: the batch came from :func:`dicts_to_batch` (JSON fields are their text)."""
        self.dropped = 0
        n = batch.num_rows
        names = batch.schema.names
        if n == 0 or len(set(names)) != len(names):
            return None
        extra = {self.key_field, KEY_COLUMN}
        if {c for c in names if c not in extra} != set(self.names) or len(positions) != n:
            return None
        keys, from_data = self._keys(batch, positions)
        if keys is None:
            return None
        arrays, sizes, lengths = [keys], [], None
        for spec in self.fields:
            col = batch.column(names.index(spec.name))
            want = spec.name == self.length_field
            if spec.storage == "json":
                got = _json_field(col, json_as_text)
            elif col.null_count:
                return None
            elif spec.storage == "array":
                got = _array_field(spec, col)
            elif spec.storage == "text":
                got = _text_field(spec, col, want)
            elif spec.storage == "int":
                got = _int_field(col)
            else:
                got = _raw_field(spec, col, want)
            if got is None:
                return None
            arrays.append(got[0])
            sizes.append(got[1])
            if want:
                lengths = got[2]
                if lengths is None or (len(lengths) and int(lengths.min()) < 0):
                    return None
        size_matrix = np.stack(sizes, axis=1) if sizes else np.zeros((n, 0), np.int64)
        if self.length_field is None:
            lengths = size_matrix.sum(axis=1)
        out = ShardBatch(
            pa.RecordBatch.from_arrays(arrays, schema=self.schema),
            np.asarray(lengths, np.int64),
            size_matrix,
            from_data,
        )
        if self.max_length is not None:
            keep = out.lengths <= self.max_length
            if not keep.all():
                if self.truncate:
                    return None
                self.dropped = int(n - keep.sum())
                out = out.filter(keep)
        return out


# ----------------------------------------------------------------------------- dicts → a batch
_INT_TYPES = (int, np.integer)


def _py_column(spec: FieldSpec, values: list):
    """One field of a chunk of sample dicts as an Arrow array, or None where the per-sample path
    must decide (it accepts or refuses exactly these types, so they are checked, not coerced)."""
    types = set(map(type, values))
    if spec.storage == "json":
        return pa.array([json_text(v) for v in values], type=pa.string())
    if spec.storage == "text":
        return pa.array(values, type=pa.string()) if types == {str} else None
    if spec.storage == "raw":
        return pa.array(values, type=pa.binary()) if types == {bytes} else None
    if spec.storage == "int":
        if not all(issubclass(t, _INT_TYPES) and t is not bool for t in types):
            return None
        return pa.array(values, type=pa.int64())
    dtype = np.dtype(spec.dtype)
    if types == {np.ndarray}:
        if any(v.ndim != 1 for v in values) or not all(
            np.can_cast(dt, dtype, "safe") for dt in {v.dtype for v in values}
        ):
            return None
        offsets = np.zeros(len(values) + 1, dtype=np.int64)
        np.cumsum([len(v) for v in values], out=offsets[1:])
        if offsets[-1] >= 1 << 31:
            return None
        flat = np.concatenate(values).astype(dtype, copy=False) if values else np.zeros(0, dtype)
        return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(flat))
    if types == {list}:
        arr = pa.array(values)  # inferred: list<int64> only when every element is an int
        vt = arr.type.value_type
        if pt.is_null(vt):
            return arr.cast(arrow_type(spec))
        if not pt.is_integer(vt):
            return None
        return arr
    return None


def dicts_to_batch(objs: list[dict], fields: list[FieldSpec], key_field: str | None) -> pa.RecordBatch | None:
    """A chunk of sample dicts as a record batch of the source's fields (JSON fields as their
    text: shape it with ``json_as_text=True``), or None when any dict does not fit exactly."""
    names = [f.name for f in fields]
    expected = set(names)
    extra = [k for k in (key_field, KEY_COLUMN) if k is not None and k in objs[0]]
    expected.update(extra)
    if not all(o.keys() == expected for o in objs):
        return None
    arrays, out_names = [], []
    try:
        for k in extra:
            values = [o[k] for o in objs]
            types = set(map(type, values))
            if not (types == {str} or all(issubclass(t, _INT_TYPES) and t is not bool for t in types)):
                return None
            arrays.append(pa.array(values))
            out_names.append(k)
        for spec in fields:
            arr = _py_column(spec, [o[spec.name] for o in objs])
            if arr is None:
                return None
            arrays.append(arr)
            out_names.append(spec.name)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError, ValueError):
        return None
    return pa.RecordBatch.from_arrays(arrays, names=out_names)
