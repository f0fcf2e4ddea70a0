"""`shardtool pack PREFIX`: a Megatron/NeMo indexed dataset (.bin + .idx) converted, checked row
for row against megatron-core's own reader and byte for byte against the same rows from Parquet."""

from __future__ import annotations

import os
import shutil
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed"
    warnings.simplefilter("ignore")
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

from helpers.realtext import byte_ids, stdlib_files
from helpers.runcli import shardtool_cli
from shardtool.format import open_dataset
from shardtool.format.errors import BadSampleError
from shardtool.pack import pack


def build(prefix: str, docs: list[list[np.ndarray]], dtype=np.int32) -> str:
    """Megatron's own builder: each document a list of sequences (sentences)."""
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in docs:
        for seq in doc:
            b.add_item(torch.from_numpy(np.asarray(seq, dtype=np.int64)))
        b.end_document()
    b.finalize(prefix + ".idx")
    return prefix


def megatron_documents(prefix: str) -> list[np.ndarray]:
    """Every document as megatron-core reads it: its sequences, joined."""
    ds = IndexedDataset(prefix)
    doc = ds.document_indices
    out = []
    for d in range(len(doc) - 1):
        parts = [ds[s] for s in range(doc[d], doc[d + 1])]
        out.append(np.concatenate(parts) if parts else np.zeros(0, ds.index.dtype))
    return out


def stdlib_docs(n: int) -> list[list[np.ndarray]]:
    """Real text: stdlib files as byte ids, cut into 'sentences' at newlines every ~40 lines."""
    docs = []
    for path in stdlib_files(n):
        ids = byte_ids(path)
        cuts = np.flatnonzero(ids == 10)[39::40] + 1
        docs.append([s for s in np.split(ids, cuts) if len(s)] or [ids])
    return docs


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_documents_read_back_equal_to_megatron_core_row_for_row(tmp_path, dtype):
    prefix = build(str(tmp_path / "corpus_text_document"), stdlib_docs(60), dtype=dtype)
    r = pack(prefix, str(tmp_path / "ds"), workers=2)
    ds = open_dataset(r.out)
    expected = megatron_documents(prefix)
    assert len(ds) == len(expected) == 60
    assert ds.manifest.field_names == ["tokens"] and ds.manifest.fields[0].dtype == np.dtype(dtype).str[1:]
    assert ds.manifest.length["field"] == "tokens"
    for sample, doc in zip(ds, expected):
        assert sample["tokens"].dtype == doc.dtype and np.array_equal(sample["tokens"], doc)
    assert ds.lengths.tolist() == [len(d) for d in expected]


def _same_files(a: str, b: str) -> None:
    names = sorted(os.path.relpath(os.path.join(d, f), a) for d, _, fs in os.walk(a) for f in fs)
    assert names == sorted(os.path.relpath(os.path.join(d, f), b) for d, _, fs in os.walk(b) for f in fs)
    for n in names:
        assert open(os.path.join(a, n), "rb").read() == open(os.path.join(b, n), "rb").read(), n


@pytest.mark.parametrize("fmt", ["tar", "arrow"])
def test_same_rows_as_parquet_give_the_same_dataset_byte_for_byte(tmp_path, fmt):
    rng = np.random.default_rng(3)
    docs = [[rng.integers(0, 50000, size=int(n))] for n in rng.integers(0, 300, size=9000)]
    prefix = build(str(tmp_path / "c"), docs, dtype=np.uint16)
    rows = pa.table({"tokens": pa.array([d[0].astype(np.uint16) for d in docs], type=pa.list_(pa.uint16()))})
    pq.write_table(rows, str(tmp_path / "c.parquet"), row_group_size=65536)
    for workers in (1, 3):
        a = pack(prefix + ".idx", str(tmp_path / f"m{workers}"), format=fmt, workers=workers, shard_size="256KiB")
        b = pack(
            str(tmp_path / "c.parquet"),
            str(tmp_path / f"p{workers}"),
            format=fmt,
            workers=workers,
            shard_size="256KiB",
            length="tokens",
        )
        assert a.shards > 3
        _same_files(a.out, b.out)


@pytest.fixture
def small(tmp_path):
    return build(str(tmp_path / "s"), [[np.arange(i * 10, i * 10 + 5 + i)] for i in range(20)], dtype=np.int32)


def test_a_truncated_bin_is_named_and_nothing_is_published(small, tmp_path):
    with open(small + ".bin", "r+b") as f:
        f.truncate(os.path.getsize(small + ".bin") - 10)
    with pytest.raises(
        BadSampleError, match=r"s\.bin is \d+ bytes, its \.idx says \d+: truncated \(ends inside document 19\)"
    ):
        pack(small, str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out" / "index.json")


def test_an_idx_of_another_bin_is_refused(small, tmp_path):
    other = build(str(tmp_path / "o"), [[np.arange(7)] for _ in range(20)], dtype=np.int32)
    shutil.copy(other + ".idx", small + ".idx")  # same count of documents, other lengths
    with pytest.raises(BadSampleError, match=r"s\.bin is \d+ bytes, its \.idx says"):
        pack(small, str(tmp_path / "out"))
    with open(small + ".idx", "r+b") as f:  # a pointer that does not follow the lengths
        f.seek(34 + 4 * 20 + 8 * 3)
        f.write(np.int64(12345).tobytes())
    with pytest.raises(BadSampleError, match=r"s\.idx.*sequence 3: its pointer 12345 does not follow"):
        pack(small, str(tmp_path / "out"))
    with open(small + ".idx", "r+b") as f:
        f.write(b"NOTMMIDX!")
    with pytest.raises(BadSampleError, match=r"s\.idx.*bad header"):
        pack(small, str(tmp_path / "out"))
    with open(small + ".idx", "r+b") as f:
        f.truncate(50)
    with pytest.raises(BadSampleError, match=r"s\.idx"):
        pack(small, str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out" / "index.json")


def test_cli_takes_the_prefix_or_either_file(small, tmp_path):
    for i, name in enumerate((small, small + ".bin", small + ".idx")):
        res = shardtool_cli("pack", name, "-o", str(tmp_path / f"o{i}"), "--format", "arrow")
        assert res.returncode == 0, res.stderr
        ds = open_dataset(str(tmp_path / f"o{i}"))
        assert [s["tokens"].tolist() for s in ds] == [list(range(i * 10, i * 10 + 5 + i)) for i in range(20)]
