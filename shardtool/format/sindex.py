"""The per-shard sample index: key, byte range and length of every sample.

Stored as a small Arrow IPC file beside its shard, so it is read without touching the shard:
every decision about batches, and every positioned read, comes from here.
- tar shards: per field, the payload's offset inside the sample's range and its size.
- arrow shards: the record batch and row holding the sample (offset/size = the batch's range).
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from .errors import FormatError
from .keys import MAX_KEY_BYTES, key_problem

# One vectorised pass over the key column: any character a valid key cannot hold (the rules of
# keys.key_problem), or an empty key. Only on a hit do we run the per-key check, for its message.
_BAD_KEY_RE = r"[/\\\x00-\x1f.]|^$"


def ipc_file_bytes(table: pa.Table) -> bytes:
    """A table as the bytes of an Arrow IPC file (the format of every small Arrow sidecar)."""
    sink = io.BytesIO()
    with pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue()


def as_numpy(col) -> np.ndarray:
    """A numeric Arrow array or chunked array as numpy, zero-copy where it has one chunk and no
    nulls. Not pyarrow's ``to_numpy``: its first call imports pandas, ~0.3 s of every loader
    process's start-up (before its first batch) for a module we never use."""
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    t = col.type
    if not (pa.types.is_integer(t) or pa.types.is_floating(t)) or any(c.null_count for c in chunks):
        return col.to_numpy() if isinstance(col, pa.ChunkedArray) else col.to_numpy(zero_copy_only=False)
    kind = "f" if pa.types.is_floating(t) else "i" if pa.types.is_signed_integer(t) else "u"
    dtype = np.dtype(f"<{kind}{t.bit_width // 8}")
    parts = [np.frombuffer(c.buffers()[1], dtype=dtype)[c.offset : c.offset + len(c)] for c in chunks if len(c)]
    if not parts:
        return np.zeros(0, dtype)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


@dataclass
class ShardIndex:
    keys: list[str]  # read from a file: a list; being written: a list or an Arrow string array
    offsets: np.ndarray  # uint64, byte offset of the sample (tar) or of its record batch (arrow)
    sizes: np.ndarray  # uint64
    lengths: np.ndarray  # int64
    field_offsets: np.ndarray | None = None  # [n, F] uint32, tar only
    field_sizes: np.ndarray | None = None  # [n, F] uint64, tar only
    batch: np.ndarray | None = None  # int32, arrow only
    row: np.ndarray | None = None  # int32, arrow only
    # xxh3-64 of each sample's byte range, so a ranged read (no whole-shard hash possible) is
    # still verified before use. Absent in indexes written before it existed.
    checksums: np.ndarray | None = None  # uint64

    def __len__(self) -> int:
        return len(self.keys)

    def to_bytes(self, field_names: list[str]) -> bytes:
        cols = {
            "key": self.keys if isinstance(self.keys, pa.Array) else pa.array(self.keys, type=pa.string()),
            "offset": pa.array(self.offsets.astype(np.uint64)),
            "size": pa.array(self.sizes.astype(np.uint64)),
            "length": pa.array(self.lengths.astype(np.int64)),
        }
        if self.field_offsets is not None:
            for j, name in enumerate(field_names):
                cols[f"o:{name}"] = pa.array(self.field_offsets[:, j].astype(np.uint32))
                cols[f"s:{name}"] = pa.array(self.field_sizes[:, j].astype(np.uint64))  # type: ignore[index]  # set with field_offsets
        if self.batch is not None:
            cols["batch"] = pa.array(self.batch.astype(np.int32))
            cols["row"] = pa.array(self.row.astype(np.int32))  # type: ignore[union-attr]  # set with batch
        if self.checksums is not None:
            cols["xxh3_64"] = pa.array(self.checksums.astype(np.uint64))
        return ipc_file_bytes(pa.table(cols))

    @classmethod
    def from_bytes(cls, data: bytes, field_names: list[str], *, shard: str, tar: bool) -> ShardIndex:
        try:
            table = pa.ipc.open_file(pa.py_buffer(data)).read_all()
        except (pa.ArrowInvalid, OSError) as e:
            raise FormatError(f"{shard}: sample index is unreadable ({e})") from None
        names = set(table.column_names)
        need = {"key", "offset", "size", "length"}
        if tar:
            need |= {f"o:{n}" for n in field_names} | {f"s:{n}" for n in field_names}
        else:
            need |= {"batch", "row"}
        missing = need - names
        if missing:
            raise FormatError(f"{shard}: sample index lacks columns {sorted(missing)}")

        keys = table.column("key").to_pylist()
        check_keys(table.column("key"), shard, keys)

        def col(name: str, dtype) -> np.ndarray:
            return as_numpy(table.column(name)).astype(dtype, copy=False)

        idx = cls(
            keys=keys,
            offsets=col("offset", np.uint64),
            sizes=col("size", np.uint64),
            lengths=col("length", np.int64),
        )
        if tar:
            n = len(idx.keys)
            idx.field_offsets = np.empty((n, len(field_names)), dtype=np.uint32)
            idx.field_sizes = np.empty((n, len(field_names)), dtype=np.uint64)
            for j, name in enumerate(field_names):
                idx.field_offsets[:, j] = col(f"o:{name}", np.uint32)
                idx.field_sizes[:, j] = col(f"s:{name}", np.uint64)
        else:
            idx.batch = col("batch", np.int32)
            idx.row = col("row", np.int32)
        if "xxh3_64" in names:
            idx.checksums = col("xxh3_64", np.uint64)
        return idx

    def check(self, *, shard: str, samples: int, shard_bytes: int, lengths: np.ndarray | None) -> None:
        """Structural agreement with the manifest; raises FormatError naming the shard."""
        if len(self.keys) != samples:
            raise FormatError(f"{shard}: index has {len(self.keys)} samples, manifest says {samples}")
        if len(self.keys) and int((self.offsets + self.sizes).max()) > shard_bytes:
            raise FormatError(f"{shard}: index points past the end of the shard ({shard_bytes} bytes)")
        if lengths is not None and not np.array_equal(lengths, self.lengths):
            bad = int(np.flatnonzero(lengths != self.lengths)[0]) if len(lengths) == len(self.lengths) else 0
            raise FormatError(
                f"{shard}: sample lengths in the index disagree with the manifest's (first at sample {bad})"
            )


# The bytes of _BAD_KEY_RE's class (control characters, '/', '\\', '.'); UTF-8 continuation
# bytes are >= 0x80, so a byte test over a key's UTF-8 is the regex's character test.
_BAD_KEY_BYTE = np.zeros(256, dtype=bool)
_BAD_KEY_BYTE[:32] = True
_BAD_KEY_BYTE[[ord("/"), ord("\\"), ord(".")]] = True


def bad_keys(column) -> int | None:
    """Index of the first key pack would never write (``keys.key_problem``), or None; one
    vectorised pass over the column (``column`` has no nulls). String columns are tested with
    numpy over their UTF-8 bytes: pyarrow.compute's first call imports pandas (~0.3 s of a
    loader process's start-up, before its first batch, for one shard index)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    large = pa.types.is_large_string(column.type)
    if not (large or pa.types.is_string(column.type)):
        return _bad_keys_compute(column)
    if len(column) == 0:
        return None
    _, off_buf, data_buf = column.buffers()
    offsets = np.frombuffer(off_buf, np.int64 if large else np.int32)
    offsets = offsets[column.offset : column.offset + len(column) + 1].astype(np.int64)
    sizes = np.diff(offsets)
    bad = (sizes == 0) | (sizes > MAX_KEY_BYTES)
    if data_buf is not None:
        data = np.frombuffer(data_buf, np.uint8)[offsets[0] : offsets[-1]]
        hits = np.flatnonzero(_BAD_KEY_BYTE[data]) + offsets[0]
        bad[np.searchsorted(offsets, hits, side="right") - 1] = True  # the sample holding each byte
    first = np.flatnonzero(bad)
    return int(first[0]) if first.size else None


def _bad_keys_compute(column) -> int | None:
    import pyarrow.compute as pc

    bad = pc.or_(pc.match_substring_regex(column, _BAD_KEY_RE), pc.greater(pc.binary_length(column), MAX_KEY_BYTES))
    if not pc.any(bad).as_py():
        return None
    return int(np.flatnonzero(bad.to_numpy(zero_copy_only=False))[0])


def check_keys(column, shard: str, keys: list[str] | None = None) -> None:
    """Refuse an index (hand-made or hostile) holding a key pack would never write, or a key twice.

    Keys become member names and cache/loader identities, so a '../' or NUL in one must not reach
    them; raises FormatError naming the shard and the first bad sample. ``keys``: the column as
    a list, where the caller has it.
    """
    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if column.null_count:
        raise FormatError(f"{shard}: sample index holds a null key")
    i = bad_keys(column)
    if i is not None:
        key = column[i].as_py()
        raise FormatError(f"{shard}: sample #{i} has an invalid key ({key_problem(key) or f'key {key!r}'})")
    keys = column.to_pylist() if keys is None else keys
    if len(set(keys)) != len(keys):
        seen: set[str] = set()
        for i, k in enumerate(keys):
            if k in seen:
                raise FormatError(f"{shard}: duplicate key {k!r} in the sample index (again at sample #{i})")
            seen.add(k)
