"""A shuffled or selected Hugging Face Dataset (an indices mapping) packs like its flattened rows.

The data is real: Python's own stdlib sources read as byte ids, one document per file. The
dataset is shuffled and selected, the way a user takes a random subset before packing; its
rows reach the packer as whole record batches (one per slice), never one batch per row, and
give the same bytes as ``flatten_indices()`` and as a Parquet file of the same rows. Equal
bytes also need equal Arrow types: dicts of Python ints are int64, a Parquet file may say int32.
"""

from __future__ import annotations

import glob
import importlib
import os
import sysconfig

import datasets  # noqa: E402  a declared test dependency
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import shardtool
from helpers.skips import require

sources = importlib.import_module("shardtool.pack.sources")  # `shardtool.pack` is also the function
readers = importlib.import_module("shardtool.pack.readers")

pytestmark = pytest.mark.timeout(240)
ROWS = 10_000  # more than one unit of rows (sources.UNIT_ROWS), so two workers both pack some
DOC_BYTES = 1024


def stdlib_docs(n: int) -> list[np.ndarray]:
    """The first ``DOC_BYTES`` of the stdlib's .py files, in path order, as uint8 token ids."""
    paths = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), recursive=True))
    docs = []
    for p in paths:
        with open(p, "rb") as f:
            data = f.read(DOC_BYTES)
        if data:
            docs.append(np.frombuffer(data, np.uint8))
        if len(docs) == n:
            return docs
    require(False, f"the stdlib here has fewer than {n} non-empty .py files")


@pytest.fixture(scope="module")
def shuffled():
    docs = stdlib_docs(ROWS + 2_000)
    offsets = np.zeros(len(docs) + 1, np.int32)
    np.cumsum([len(d) for d in docs], out=offsets[1:])
    table = pa.table(
        {
            "tokens": pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(docs))),
            "doc": pa.array(np.arange(len(docs), dtype=np.int32)),
        }
    )
    return datasets.Dataset(table).shuffle(seed=1).select(range(ROWS))


def _version(path) -> str:
    return shardtool.open_dataset(str(path)).version


@pytest.mark.parametrize("workers", [1, 2])
def test_shuffled_selection_packs_like_its_flattened_rows_and_parquet(shuffled, tmp_path, workers):
    flat = shuffled.flatten_indices()
    parquet = str(tmp_path / "rows.parquet")
    pq.write_table(flat.data.table, parquet, row_group_size=sources.UNIT_ROWS)
    opts = dict(format="arrow", length="tokens", shard_size=2 << 20, workers=workers)
    got = {}
    for name, src in (("indices", shuffled), ("flat", flat), ("parquet", parquet)):
        shardtool.pack(src, str(tmp_path / name), **opts)
        got[name] = _version(tmp_path / name)
    assert got["indices"] == got["flat"] == got["parquet"], got
    ds = shardtool.open_dataset(str(tmp_path / "indices"))
    first = next(iter(ds))
    assert first["doc"] == shuffled[0]["doc"] and first["tokens"].tolist() == shuffled[0]["tokens"]
    assert len(ds) == ROWS and ds.num_shards > workers


def test_shuffled_selection_reaches_the_packer_as_one_batch_per_slice(shuffled):
    """What made it 15-30x slower than flattened rows: a one-row record batch per sample."""
    units = sources.memory_units(shuffled, 0, 1)
    assert [u.count for u in units] == [sources.UNIT_ROWS, ROWS - sources.UNIT_ROWS]
    for unit in units:
        batches = list(readers.read_unit(unit, max_sample_bytes=1 << 20, on_bad=None, whole_batches=True))
        assert [b.batch.num_rows for b in batches] == [unit.count]


def test_fragmented_slices_are_copied_in_bounded_groups_and_others_kept(shuffled):
    """Large rows are not all copied at once; batches already large in bytes are left alone."""
    table = shuffled.with_format("arrow")[0:1000]  # the Dataset's own gather: a batch per row
    assert table.column(0).num_chunks == 1000
    budget = table.nbytes // 4
    groups = list(sources.contiguous(table, combine_bytes=budget))
    # Rows are counted at their average size: a group holds about the budget, not exactly.
    assert 4 <= len(groups) <= 5 and all(g.nbytes <= 1.5 * budget for g in groups)
    assert pa.Table.from_batches(groups).equals(table)
    big = pa.table({"blob": pa.array([b"x" * (2 << 20)] * 3)})
    split = pa.Table.from_batches(big.to_batches(max_chunksize=1))
    assert [b.num_rows for b in sources.contiguous(split)] == [1, 1, 1]  # 2 MiB a batch: kept


def test_same_bytes_need_the_same_arrow_types(tmp_path):
    """README: dicts of Python ints are int64 arrays; with the Parquet file's schema, the same bytes."""
    rows = [{"tokens": d.astype(np.int32).tolist()} for d in stdlib_docs(300)]
    schema = pa.schema([("tokens", pa.list_(pa.int32()))])
    parquet = str(tmp_path / "rows.parquet")
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), parquet)
    for name, src in (("parquet", parquet), ("dicts", rows), ("typed", pa.Table.from_pylist(rows, schema=schema))):
        shardtool.pack(src, str(tmp_path / name), format="arrow", length="tokens")
    dtypes = {
        n: {f.name: f.dtype for f in shardtool.open_dataset(str(tmp_path / n)).manifest.fields}
        for n in ("parquet", "dicts", "typed")
    }
    assert dtypes["parquet"]["tokens"] == dtypes["typed"]["tokens"] == "i4" and dtypes["dicts"]["tokens"] == "i8"
    assert _version(tmp_path / "typed") == _version(tmp_path / "parquet") != _version(tmp_path / "dicts")
