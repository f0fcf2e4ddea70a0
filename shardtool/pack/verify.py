"""``shardtool verify``: rehash every shard and check every index entry against its shard.

Never raises on a bad shard: every shard is checked and each problem is reported with the
shard's path, so one run lists all the damage.
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Callable

import numpy as np
import pyarrow as pa

from ..format.arrowshard import check_schema
from ..format.damage import check_shard_bytes
from ..format.dataset import Dataset, is_local, open_dataset
from ..format.errors import FormatError
from ..format.fields import FieldSpec, decode_bytes, length_of
from ..format.hashing import check_algo
from ..format.summaries import SUMMARIES_NAME, ShardSummaries
from ..format.tarshard import check_sample_range


def _shard_bytes(ds: Dataset, shard: int):
    fs, path = ds.shard_fs(shard), ds.shard_path(shard)
    if is_local(fs):
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            return mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else b""
        finally:
            os.close(fd)
    return fs.cat_file(path)


def verify_shard(ds: Dataset, shard: int, *, against_lengths: bool = True) -> None:
    """``shard``'s bytes, index and samples checked; ``against_lengths`` False where the lengths
    file is bad (reported once, apart): each shard is then checked on its own."""
    info = ds.manifest.shards[shard]
    check_algo(info.hash)
    try:
        data = _shard_bytes(ds, shard)
    except FileNotFoundError:
        raise FormatError(f"{info.path}: shard file is missing") from None
    try:
        check_shard_bytes(ds, shard, data)
        idx = ds.shard_index(shard, against_lengths=against_lengths)  # hash, count, ranges, lengths
        if ds.manifest.shard_format == "tar":
            exts = [f.ext for f in ds.manifest.fields]
            field_offsets, field_sizes = idx.field_offsets, idx.field_sizes
            if field_offsets is None or field_sizes is None:  # a tar index is read with both columns
                raise FormatError(f"{info.path}: the tar shard's index has no field offsets and sizes")
            for i, key in enumerate(idx.keys):
                off, size = int(idx.offsets[i]), int(idx.sizes[i])
                check_sample_range(data[off : off + size], key, exts, field_offsets[i], field_sizes[i], info.path)
            spec = _length_spec(ds)
            if spec is not None:
                j = ds.manifest.field_names.index(spec.name)
                _compare_lengths(info.path, spec, idx, _tar_lengths(data, idx, spec, j))
        else:
            _verify_arrow(ds, shard, data, idx)
    finally:
        if isinstance(data, mmap.mmap):
            data.close()


def _arrow_rows(data, fields, spec, shard: str):
    """(keys per batch, lengths per batch, problem or None). Never raises, so no traceback keeps a
    view of the mmap alive (that makes the caller's mmap.close() fail with BufferError)."""
    keys: list[list[str]] = []
    lengths: list[list[int]] = []
    try:
        reader = pa.ipc.open_file(pa.py_buffer(data))
        check_schema(reader.schema, fields, shard)
        for b in range(reader.num_record_batches):
            batch = reader.get_batch(b)
            keys.append(batch.column(0).to_pylist())
            if spec is not None:
                lengths.append(_arrow_lengths(batch, spec))
    except FormatError as e:
        return keys, lengths, str(e)
    except pa.ArrowInvalid as e:
        return keys, lengths, f"{shard}: not a readable Arrow IPC file ({e})"
    return keys, lengths, None


def _verify_arrow(ds: Dataset, shard: int, data, idx) -> None:
    info = ds.manifest.shards[shard]
    spec = _length_spec(ds)
    keys, lengths, problem = _arrow_rows(data, ds.manifest.fields, spec, info.path)
    if problem is not None:
        raise FormatError(problem)
    for i, key in enumerate(idx.keys):
        b, r = int(idx.batch[i]), int(idx.row[i])
        if not (0 <= b < len(keys) and 0 <= r < len(keys[b])) or keys[b][r] != key:
            raise FormatError(f"{info.path}: index entry #{i} ({key!r}) does not match the shard's row")
    if sum(len(k) for k in keys) != len(idx.keys):
        raise FormatError(f"{info.path}: {sum(len(k) for k in keys)} rows in the shard, index has {len(idx.keys)}")
    if spec is not None:
        _compare_lengths(info.path, spec, idx, [lengths[int(idx.batch[i])][int(idx.row[i])] for i in range(len(idx))])


def _length_spec(ds: Dataset) -> FieldSpec | None:
    name = ds.manifest.length.get("field")
    return ds.manifest.field(name) if name else None


def _field_length(spec: FieldSpec, value, where: str) -> int:
    try:
        return length_of(spec, value)
    except (ValueError, TypeError) as e:
        raise FormatError(f"{where}: length field {spec.name!r} unreadable ({e})") from None


def _arrow_lengths(batch, spec: FieldSpec) -> list[int]:
    col = batch.column(spec.name)
    if spec.storage == "array":
        return np.diff(col.offsets.to_numpy()).tolist()
    values = col.to_pylist()
    if spec.storage == "json":
        values = [json.loads(v) for v in values]
    return [_field_length(spec, v, f"row {r}") for r, v in enumerate(values)]


def _tar_lengths(data, idx, spec: FieldSpec, j: int) -> list[int]:
    out = []
    for i in range(len(idx)):
        start = int(idx.offsets[i]) + int(idx.field_offsets[i, j])
        payload = data[start : start + int(idx.field_sizes[i, j])]
        value = payload if spec.storage == "raw" else decode_bytes(spec.encoding, payload)
        out.append(_field_length(spec, value, f"sample {idx.keys[i]!r}"))
    return out


def _compare_lengths(shard: str, spec: FieldSpec, idx, actual: list[int]) -> None:
    """The recorded lengths (index, and so lengths.npy) must be the length field's: bucketing uses them."""
    actual_arr = np.asarray(actual, dtype=np.int64)
    if not np.array_equal(actual_arr, idx.lengths):
        i = int(np.flatnonzero(actual_arr != idx.lengths)[0])
        raise FormatError(
            f"{shard}: sample #{i} ({idx.keys[i]!r}) has length {int(actual_arr[i])} by field "
            f"{spec.name!r}, but the index and lengths file record {int(idx.lengths[i])}"
        )


def verify(
    url: str,
    *,
    storage_options: dict | None = None,
    progress: Callable[[int], None] | None = None,
    dataset: Dataset | None = None,
) -> dict:
    """Check a dataset; returns {"ok", "shards", "samples", "bytes", "bad": [{"shard", "error"}]}.

    A bad entry whose shard failed its hash also lists, under ``"samples"``, the ``index`` (within
    the shard) and ``key`` of every sample whose bytes fail their per-sample checksum.

    ``dataset``: the dataset at ``url``, already opened (and not yet read from) by the caller,
    which keeps it open and closes it; by default ``url`` is opened here.
    """
    ds = open_dataset(url, storage_options=storage_options) if dataset is None else dataset
    bad = []
    lengths_ok = True
    try:
        _ = ds.lengths  # the global lengths file against its manifest hash
    except FormatError as e:
        lengths_ok = False
        bad.append({"shard": ds.manifest.lengths_file.get("path", "lengths.npy"), "error": str(e)})
    # A summaries file that does not read as this dataset's is damage verify names, though the
    # loader survives it (it warns and plans from the lengths). None at all: packed before
    # summaries. Stale ones, computed from other lengths, the loader already names as such.
    stored = ds.read_summaries_bytes()
    if stored is not None:
        try:
            ShardSummaries.from_bytes(
                stored, lengths_hash=None, counts=ds.shard_counts, total_tokens=None, source=SUMMARIES_NAME
            )
        except FormatError as e:
            bad.append({"shard": SUMMARIES_NAME, "error": str(e)})
    for s in range(ds.num_shards):
        try:
            verify_shard(ds, s, against_lengths=lengths_ok)
        except FormatError as e:
            bad.append({"shard": ds.manifest.shards[s].path, "error": str(e)})
            samples = getattr(e, "samples", None)  # set by format.damage on the errors it raises
            if samples:
                bad[-1]["samples"] = samples
        except OSError as e:
            bad.append({"shard": ds.manifest.shards[s].path, "error": f"{ds.manifest.shards[s].path}: {e}"})
        if progress is not None:
            progress(1)
    if dataset is None:
        ds.close()
    return {
        "ok": not bad,
        "url": url,
        "shards": ds.num_shards,
        "samples": ds.manifest.num_samples,
        "bytes": ds.manifest.num_bytes,
        "version": ds.version,
        "bad": bad,
    }
