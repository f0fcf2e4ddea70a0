"""Reading the samples of one unit, streaming, with bounded memory.

Each reader yields ``(position_in_unit, key_or_None, fields_dict, where)`` for good samples and
:class:`Bad` for a sample that cannot be read, so one malformed line does not end the unit.
Compressed sources are decompressed as streams and lines are read with a length cap, so a
gzip/zstd bomb costs at most ``max_sample_bytes`` of memory before it is refused.
"""

from __future__ import annotations

import gzip
import io
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..format.errors import BadSampleError
from ..format.tarshard import iter_tar_members, split_member_name
from .tree import LABEL_FIELD
from .units import tree_key
from .workunit import FOREIGN, Unit

if TYPE_CHECKING:  # checked as json's, with or without orjson: orjson's error subclasses json's
    from json import JSONDecodeError
    from json import loads as json_loads
else:
    try:  # orjson is several times faster; json is the always-available fallback
        from orjson import JSONDecodeError
        from orjson import loads as json_loads
    except ImportError:  # pragma: no cover - exercised where orjson is absent
        from json import JSONDecodeError
        from json import loads as json_loads

PARQUET_BATCH_ROWS = 8192


@dataclass
class Bad:
    error: BadSampleError


def open_stream(path: str) -> io.BufferedReader:
    """A binary stream of a possibly compressed file, decompressed incrementally."""
    raw = open(path, "rb")
    low = path.lower()
    if low.endswith((".gz", ".tgz")):
        return io.BufferedReader(gzip.GzipFile(fileobj=raw), 1 << 20)
    if low.endswith(".zst"):
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True), 1 << 20)
    return raw


def count_lines(unit: Unit) -> int:
    """Lines of a whole (compressed) JSONL file, streamed in blocks."""
    n, last = 0, b"\n"
    with open_stream(unit.path) as f:
        while True:
            block = f.read(4 << 20)
            if not block:
                break
            n += block.count(b"\n")
            last = block[-1:]
    return n + (0 if last == b"\n" else 1)


def count_arrow_stream(unit: Unit) -> int:
    import pyarrow as pa

    with pa.OSFile(unit.path) as f:
        return sum(b.num_rows for b in pa.ipc.open_stream(f))


def count_unit(unit: Unit) -> int:
    try:
        if unit.kind == "jsonl":
            return count_lines(unit)
        return count_arrow_stream(unit)
    except (OSError, EOFError, ValueError) as e:
        raise BadSampleError(f"cannot read source ({e}) to count its samples", source=unit.path, lost=None) from None
    except Exception as e:  # zstd / arrow errors have their own classes
        raise BadSampleError(
            f"cannot read source ({type(e).__name__}: {e}) to count its samples", source=unit.path, lost=None
        ) from None


@dataclass
class ColumnBatch:
    """A whole record batch, for callers that pack batches (``read_unit(..., whole_batches=True)``);
    :func:`batch_rows` gives its rows when they cannot."""

    pos: int  # position of its first row in the unit
    batch: Any


@dataclass
class RowChunk:
    """Consecutive good records ``(pos, key, fields_dict, where)`` of a JSONL or dict source, for
    callers that pack them as one batch (``read_unit(..., whole_batches=True)``)."""

    records: list


ROW_CHUNK = 4096


def chunk_rows(records: Iterator[Any], size: int = ROW_CHUNK) -> Iterator[Any]:
    """Good records grouped into RowChunks; a Bad record ends the chunk and passes on alone."""
    chunk: list = []
    for rec in records:
        if rec.__class__ is Bad:
            if chunk:
                yield RowChunk(chunk)
                chunk = []
            yield rec
            continue
        chunk.append(rec)
        if len(chunk) >= size:
            yield RowChunk(chunk)
            chunk = []
    if chunk:
        yield RowChunk(chunk)


def read_unit(unit: Unit, *, max_sample_bytes: int, on_bad, whole_batches: bool = False) -> Iterator[Any]:
    """The unit's samples; with ``whole_batches``, Arrow data as ColumnBatches and dict records
    as RowChunks (Bad records always come alone)."""
    if unit.kind in ("jsonl", "memory") and (unit.kind == "jsonl" or unit.obj.items == "dicts"):
        records = _jsonl(unit, max_sample_bytes) if unit.kind == "jsonl" else _dicts(unit)
        return chunk_rows(records) if whole_batches else records
    if unit.structured:  # parquet, arrow, memory, and other loaders' datasets
        return _columnar(unit, whole_batches)
    if unit.kind == "tar":
        return _tar(unit, max_sample_bytes, on_bad)
    if unit.kind == "files":
        return _files(unit, max_sample_bytes)
    if unit.kind == "images":
        return _images(unit, max_sample_bytes)
    return _tree(unit, max_sample_bytes)


# --------------------------------------------------------------------------- JSONL
def _jsonl(unit: Unit, max_line: int) -> Iterator[Any]:
    try:
        f = open_stream(unit.path)
        if unit.start:
            f.seek(unit.start)
    except OSError as e:
        raise BadSampleError(f"cannot read source ({e})", source=unit.path) from None
    remaining = unit.stop - unit.start if unit.stop >= 0 else -1
    line_no = unit.first_line
    with f:
        while remaining != 0:
            try:
                line = f.readline(max_line + 1)
            except (OSError, EOFError) as e:
                raise BadSampleError(
                    f"cannot read source after line {line_no} ({e}); the rest of it is lost",
                    source=unit.path,
                    lost=None,
                ) from None
            except Exception as e:  # zstd raises its own error type on corrupt frames
                raise BadSampleError(
                    f"cannot decompress after line {line_no} ({type(e).__name__}: {e}); the rest of it is lost",
                    source=unit.path,
                    lost=None,
                ) from None
            if not line:
                break
            if remaining > 0:
                remaining -= len(line)
            pos = line_no - unit.first_line
            line_no += 1
            where = f"line {line_no}"
            if len(line) > max_line:
                # Never read the rest of an over-long line into memory: refuse the source.
                raise BadSampleError(
                    f"line is longer than the {max_line}-byte sample limit (corrupt or compressed-bomb input?)",
                    source=unit.path,
                    position=where,
                )
            if not line.strip():
                continue
            try:
                obj = json_loads(line)
            except (JSONDecodeError, ValueError) as e:
                yield Bad(BadSampleError(f"malformed JSON ({e})", source=unit.path, position=where))
                continue
            if not isinstance(obj, dict):
                yield Bad(
                    BadSampleError(
                        f"expected a JSON object, got {type(obj).__name__}", source=unit.path, position=where
                    )
                )
                continue
            yield pos, None, obj, where


# --------------------------------------------------------------------------- Parquet / Arrow
def _column_values(col) -> list:
    """Per-row values of an Arrow column; numeric lists become numpy views, no Python lists."""
    import pyarrow as pa
    import pyarrow.types as pt

    t = col.type
    if (
        (pt.is_list(t) or pt.is_large_list(t))
        and col.null_count == 0
        and col.values.null_count == 0
        and (pt.is_integer(t.value_type) or pt.is_floating(t.value_type))
    ):
        offsets = col.offsets.to_numpy()
        values = col.values.to_numpy()
        return [values[offsets[i] : offsets[i + 1]] for i in range(len(col))]
    if (pt.is_integer(t)) and col.null_count == 0:
        return col.to_numpy().tolist()
    if isinstance(col, pa.ChunkedArray):  # pragma: no cover - batches hold plain arrays
        col = col.combine_chunks()
    return col.to_pylist()


def _batches(unit: Unit):
    import pyarrow as pa

    if unit.kind == "memory":
        yield from unit.obj.batches(unit.start, unit.stop)
        return
    if unit.kind in FOREIGN:
        from .foreign import foreign_batches

        yield from foreign_batches(unit)
        return
    if unit.kind == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(unit.path)
        yield from pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=[unit.start], use_threads=False)
        return
    if unit.stop < 0:
        with pa.OSFile(unit.path) as f:
            yield from pa.ipc.open_stream(f)
        return
    with pa.memory_map(unit.path) as src:
        reader = pa.ipc.open_file(src)
        for i in range(unit.start, unit.stop):
            yield reader.get_batch(i)


def _columnar(unit: Unit, whole_batches: bool = False) -> Iterator[Any]:
    pos = 0
    try:
        for batch in _batches(unit):
            if whole_batches:
                yield ColumnBatch(pos, batch)
            else:
                yield from batch_rows(unit, batch, pos)
            pos += batch.num_rows
    except (OSError, ValueError) as e:
        raise _unreadable_rows(unit, pos, e) from None


def _unreadable_rows(unit: Unit, pos: int, e: BaseException) -> BadSampleError:
    """A unit unreadable from row ``pos`` on: its remaining rows are what a skip of it loses."""
    lost = unit.count - pos if unit.count >= 0 else None
    where = _row_where(unit, pos)
    rest = f"its {lost} rows from there are lost" if lost is not None else "the rest of the source is lost"
    return BadSampleError(f"cannot read source near {where} ({e}); {rest}", source=unit.path, lost=lost)


def batch_rows(unit: Unit, batch, pos: int) -> Iterator[Any]:
    """The rows of one record batch whose first row is at ``pos`` in the unit."""
    try:
        names = batch.schema.names
        cols = [_column_values(batch.column(j)) for j in range(batch.num_columns)]
    except (OSError, ValueError) as e:
        raise _unreadable_rows(unit, pos, e) from None
    for r in range(batch.num_rows):
        yield pos, None, {n: c[r] for n, c in zip(names, cols)}, _row_where(unit, pos)
        pos += 1


def _row_where(unit: Unit, pos: int) -> str:
    if unit.kind in FOREIGN:
        from .foreign import where

        return where(unit, pos)
    if unit.kind == "memory":
        return f"row {unit.start + pos}"
    if unit.kind == "parquet":
        return f"row group {unit.start}, row {pos}"
    return f"record batches {unit.start}.., row {pos}" if unit.start else f"row {pos}"


def _dicts(unit: Unit) -> Iterator[Any]:
    """Records of a sequence or stream of dicts; anything else is a Bad row, named by its index."""
    for pos, obj in enumerate(unit.obj.batches(unit.start, unit.stop)):
        where = f"row {unit.start + pos}"
        if not isinstance(obj, dict):
            yield Bad(
                BadSampleError(
                    f"expected a dict (one sample), got {type(obj).__name__}", source=unit.path, position=where
                )
            )
            continue
        yield pos, None, obj, where


# --------------------------------------------------------------------------- tar and trees
def _tar(unit: Unit, max_member: int, on_bad) -> Iterator[Any]:
    try:
        f = open_stream(unit.path)
    except OSError as e:
        raise BadSampleError(f"cannot read source ({e})", source=unit.path) from None
    current: str | None = None
    fields: dict[str, bytes] = {}
    first_member = ""
    pos = 0
    with f:
        for name, data in iter_tar_members(f, unit.path, max_member_bytes=max_member, on_bad=on_bad):
            try:
                raw_key, ext = split_member_name(name)
            except ValueError as e:
                yield Bad(BadSampleError(str(e), source=unit.path, position=f"member {name!r}"))
                continue
            directory, _, stem = raw_key.rpartition("/")
            key = tree_key(directory, stem)
            if key != current:
                if current is not None:
                    yield pos, current, fields, f"member {first_member!r}"
                    pos += 1
                current, fields, first_member = key, {}, name
            if ext in fields:
                yield Bad(
                    BadSampleError(
                        f"field {ext!r} appears twice in sample {key!r}", source=unit.path, position=f"member {name!r}"
                    )
                )
                continue
            fields[ext] = data
    if current is not None:
        yield pos, current, fields, f"member {first_member!r}"


def read_whole_file(path: str, max_bytes: int) -> bytes:
    """The bytes of one source file; a file past the sample limit is refused before it is read."""
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise BadSampleError(f"cannot read ({e})", source=path) from None
    if len(data) > max_bytes:
        raise BadSampleError(f"file is larger than the {max_bytes}-byte sample limit (--max-sample-bytes)", source=path)
    return data


def _tree(unit: Unit, max_bytes: int) -> Iterator[Any]:
    for i, (key, members) in enumerate(unit.members):
        try:
            fields = {ext: read_whole_file(path, max_bytes) for ext, path in members}
        except BadSampleError as e:
            yield Bad(e)
            continue
        yield i, key, fields, members[0][1]


def _files(unit: Unit, max_bytes: int) -> Iterator[Any]:
    for i, (key, rel, path) in enumerate(unit.members):
        try:
            data = read_whole_file(path, max_bytes)
        except BadSampleError as e:
            yield Bad(e)
            continue
        yield i, key, {"bin": data, "path": rel}, path


def _images(unit: Unit, max_bytes: int) -> Iterator[Any]:
    """ImageFolder samples: the file's bytes under its extension, and its class index as decimal
    text under ``cls`` (WebDataset's convention, which decodes it to an int)."""
    for i, (key, field, label, path) in enumerate(unit.members):
        try:
            data = read_whole_file(path, max_bytes)
        except BadSampleError as e:
            yield Bad(e)
            continue
        yield i, key, {field: data, LABEL_FIELD: b"%d" % label}, path
