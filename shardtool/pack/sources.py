"""In-memory sources: what ``pack(source, ...)`` accepts besides paths, as units of work.

- a ``pyarrow.Table``, a Hugging Face ``datasets.Dataset`` (through its Arrow table, shuffles and
  selections included) and a sequence of dicts (a list or tuple) are split by row ranges, so
  ``workers`` processes pack them in parallel (forked workers share the parent's memory); each
  range is read as whole record batches, never as a batch per row (`contiguous`);
- a ``pyarrow.dataset.Dataset`` is split by fragment (a file each, usually);
- a ``pyarrow.RecordBatchReader``, a Hugging Face ``IterableDataset`` (through its Arrow
  batches) and any other iterable of dicts (a generator) are *streams*: read once, in order, by
  one process.

``datasets`` is never imported: its objects are recognised by what they have (duck typing).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from ..format.errors import ShardtoolError
from .units import Unit

UNIT_ROWS = 8192  # rows per unit of a table or sequence: small enough to balance a few workers
STREAM_BATCH_ROWS = 8192
# A slice whose record batches average fewer rows and bytes than these is copied into larger
# ones (`contiguous`), about COMBINE_BYTES each.
FRAGMENTED_ROWS = 64
FRAGMENTED_BYTES = 1 << 20
COMBINE_BYTES = 64 << 20

ACCEPTED = (
    "a path (str or os.PathLike: a directory, .jsonl[.gz|.zst], .parquet, .arrow, .tar) or a list of "
    "paths; a pyarrow.Table, pyarrow.RecordBatchReader or pyarrow.dataset.Dataset; a Hugging Face "
    "datasets.Dataset or IterableDataset; or an iterable of dicts (a list, a generator), one dict per "
    "sample"
)


class ArrowSlices:
    """Row ranges of something that slices into Arrow tables (a pyarrow.Table, an HF Dataset)."""

    items = "arrow"

    def __init__(self, name: str, rows: int, slicer, nbytes: int):
        self.name, self.rows, self._slice, self.nbytes = name, rows, slicer, nbytes

    def batches(self, start: int, stop: int) -> Iterator[Any]:
        for a in range(start, stop, STREAM_BATCH_ROWS):
            yield from contiguous(self._slice(a, min(stop, a + STREAM_BATCH_ROWS)))


def contiguous(table, combine_bytes: int = COMBINE_BYTES) -> Iterator[Any]:
    """The record batches of ``table``; if it is fragmented, copied into few, larger ones.

    A shuffled or selected HF Dataset (an indices mapping) gathers a slice as one zero-copy
    one-row slice per row; packed batch by batch, that is a record batch per sample, 20-30
    times slower than the same rows flattened. One copy of the slice costs far less, in groups
    of about ``combine_bytes`` (rows counted at the slice's average size), so that large rows,
    images say, are not all copied at once. Batches that are small in rows but not in bytes are
    left as they are: beside their bytes, their per-batch cost is noise.
    (Not ``Table.take`` on the dataset: on a table of several chunks, pyarrow concatenates the
    whole column first, a cost of the whole dataset per slice.)
    """
    chunks = table.column(0).num_chunks if table.num_columns else 0
    if table.num_rows >= FRAGMENTED_ROWS * chunks or table.nbytes >= FRAGMENTED_BYTES * chunks:
        yield from table.to_batches()
        return
    rows = max(1, combine_bytes * table.num_rows // max(table.nbytes, 1))
    for a in range(0, table.num_rows, rows):
        yield from table.slice(a, rows).combine_chunks().to_batches()


class Fragment:
    """One fragment (file) of a pyarrow.dataset.Dataset."""

    items = "arrow"

    def __init__(self, name: str, fragment, schema):
        self.name, self.fragment, self.schema = name, fragment, schema

    def batches(self, start: int, stop: int) -> Iterator[Any]:
        yield from self.fragment.to_batches(schema=self.schema, batch_size=STREAM_BATCH_ROWS, use_threads=False)


class DictRows:
    """Row ranges of a sequence of dicts."""

    items = "dicts"

    def __init__(self, name: str, rows):
        self.name, self.rows_seq = name, rows

    def batches(self, start: int, stop: int) -> Iterator[Any]:
        return iter(self.rows_seq[start:stop])


class Stream:
    """A one-shot iterator of dicts or of Arrow batches. Items read before packing starts (the
    first sample, to infer the fields) are kept and replayed, so nothing is read twice."""

    def __init__(self, name: str, iterator: Iterator[Any], items: str):
        self.name, self.items = name, items
        self._it = iterator
        self._seen: list[Any] = []
        self._started = False
        self.consumed = 0  # items handed out once packing started (rows for dicts)

    def batches(self, start: int = 0, stop: int = -1) -> Iterator[Any]:
        if self._started:
            raise ShardtoolError(f"{self.name}: a stream can be read only once")
        self._started = True
        for x in itertools.chain(self._seen, self._it):
            self.consumed += x.num_rows if self.items == "arrow" else 1
            yield x
        self._seen = []

    def peek(self) -> Iterator[Any]:
        """The items, recording what is read so that :meth:`batches` replays it."""
        yield from self._seen
        for x in self._it:
            self._seen.append(x)
            yield x


def _hf_kind(obj) -> str | None:
    """'dataset' / 'iterable' for Hugging Face datasets objects, by what they have."""
    if not (hasattr(obj, "with_format") and hasattr(obj, "features")):
        return None
    if hasattr(obj, "__len__") and hasattr(obj, "__getitem__") and hasattr(obj, "data"):
        return "dataset"
    if hasattr(obj, "iter") and hasattr(obj, "__iter__"):
        return "iterable"
    return None


def is_path(x) -> bool:
    import os

    return isinstance(x, (str, os.PathLike))


def describe(obj, i: int, n: int) -> str:
    what = type(obj).__module__.split(".")[0] + "." + type(obj).__name__
    return f"<source #{i}: {what}>" if n > 1 else f"<{what}>"


def classify(source) -> list[Any]:
    """The user's ``source`` argument as a list of sources: paths (str) and in-memory objects
    (each a list of dicts counts as one source). Raises TypeError listing what is accepted."""
    import os

    if is_path(source):
        return [os.fspath(source)]
    if isinstance(source, dict):
        raise TypeError(
            f"pack got a single dict; pass a list (or other iterable) of dicts, one per sample. Accepted: {ACCEPTED}"
        )
    if isinstance(source, (list, tuple)):
        if not source:
            return []
        if isinstance(source[0], dict):  # samples; any non-dict among them is a bad row, named by index
            return [source]
        if all(is_path(x) or _one_source(x) for x in source):
            return [os.fspath(x) if is_path(x) else x for x in source]
        kinds = sorted({type(x).__name__ for x in source})
        raise TypeError(
            f"pack got a list of {', '.join(kinds)}; a list must hold only dicts (one per sample) or "
            f"only sources. Accepted: {ACCEPTED}"
        )
    if _one_source(source) or hasattr(source, "__iter__"):
        return [source]
    raise TypeError(f"pack cannot read a {type(source).__module__}.{type(source).__name__}. Accepted: {ACCEPTED}")


def _one_source(x) -> bool:
    import pyarrow as pa

    if isinstance(x, (pa.Table, pa.RecordBatchReader, pa.RecordBatch)) or _hf_kind(x):
        return True
    try:
        import pyarrow.dataset as pads
    except ImportError:  # pragma: no cover - part of every pyarrow wheel
        return False
    return isinstance(x, pads.Dataset)


def memory_source(obj, name: str):
    """The adapter for one in-memory source: ArrowSlices, DictRows, a list of Fragments, or a Stream."""
    import pyarrow as pa

    if isinstance(obj, pa.RecordBatch):
        obj = pa.Table.from_batches([obj])
    if isinstance(obj, pa.Table):
        return ArrowSlices(name, obj.num_rows, lambda a, b: obj.slice(a, b - a), obj.nbytes)
    if isinstance(obj, pa.RecordBatchReader):
        return Stream(name, iter(obj), "arrow")
    kind = _hf_kind(obj)
    if kind == "dataset":
        arrow = obj.with_format("arrow")  # slices honour the dataset's shuffle/select indices
        nbytes = getattr(getattr(obj, "data", None), "nbytes", 0) or len(obj)
        return ArrowSlices(name, len(obj), lambda a, b: arrow[a:b], nbytes)
    if kind == "iterable":
        # Arrow batches where the dataset is backed by Arrow data; a generator-backed one yields
        # Python rows (its Arrow conversion refuses rows whose inferred types differ, e.g. an
        # empty list after a list of ints).
        examples = getattr(obj, "_ex_iterable", None)
        if examples is not None and getattr(examples, "iter_arrow", None) is None:
            return Stream(name, iter(obj), "dicts")
        return Stream(name, _tables_to_batches(obj.with_format("arrow").iter(batch_size=STREAM_BATCH_ROWS)), "arrow")
    try:
        import pyarrow.dataset as pads

        if isinstance(obj, pads.Dataset):
            return [
                Fragment(f"{name} fragment {getattr(f, 'path', i)}", f, obj.schema)
                for i, f in enumerate(obj.get_fragments())
            ]
    except ImportError:  # pragma: no cover
        pass
    if isinstance(obj, (list, tuple)):
        return DictRows(name, obj)
    try:
        it = iter(obj)
    except TypeError:
        raise TypeError(f"pack cannot read a {type(obj).__name__}. Accepted: {ACCEPTED}") from None
    return Stream(name, it, "dicts")


def _tables_to_batches(tables) -> Iterator[Any]:
    for t in tables:
        yield from t.to_batches()


def memory_units(obj, i: int, n: int) -> list[Unit]:
    """Units of one in-memory source (see the module docstring)."""
    name = describe(obj, i, n)
    src = memory_source(obj, name)
    if isinstance(src, list):  # fragments of a pyarrow dataset
        return [
            Unit("memory", f.name, 0, -1, f.fragment.count_rows(), weight=max(f.fragment.count_rows(), 1), obj=f)
            for f in src
        ]
    if isinstance(src, Stream):
        first = next(iter(src.peek()), None)
        if src.items == "dicts" and first is not None and not isinstance(first, dict):
            raise TypeError(f"pack got an iterable of {type(first).__name__}, not of dicts. Accepted: {ACCEPTED}")
        return [Unit("memory", name, 0, -1, -1, weight=1, obj=src)]
    rows = src.rows if isinstance(src, ArrowSlices) else len(src.rows_seq)
    per_row = (src.nbytes / rows) if isinstance(src, ArrowSlices) and rows else 1.0
    return [
        Unit(
            "memory",
            name,
            a,
            min(rows, a + UNIT_ROWS),
            min(rows, a + UNIT_ROWS) - a,
            weight=max(int((min(rows, a + UNIT_ROWS) - a) * per_row), 1),
            obj=src,
        )
        for a in range(0, rows, UNIT_ROWS)
    ]
