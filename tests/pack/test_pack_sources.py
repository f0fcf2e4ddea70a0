"""pack() from in-memory sources: every kind round-trips and gives the dataset a Parquet file of the
same rows gives; bad rows are named by index; unsupported objects get a TypeError."""

from __future__ import annotations

import os

import datasets  # noqa: E402  a declared test dependency
import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shardtool
from shardtool.format.errors import BadSampleError, ShardtoolError


def _rows(n: int = 300, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        k = int(rng.integers(0, 40))
        rows.append(
            {
                "tokens": rng.integers(0, 50_000, k).tolist(),
                "text": "é" * (i % 5) + f"doc {i}\n",
                "n": int(rng.integers(-5, 10**12)),
                "blob": rng.bytes(int(rng.integers(0, 600))) + b"\x00",
                "meta": {"a": i, "tags": [f"t{j}" for j in range(1 + i % 3)], "deep": {"x": [0.5, i + 0.25]}},
            }
        )
    return rows


def _version(path) -> str:
    return shardtool.open_dataset(str(path)).version


def _sources(rows, tmp_path):
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, str(tmp_path / "rows.parquet"), row_group_size=70)
    pq.write_table(table.slice(0, 150), str(tmp_path / "part-0.parquet"))
    pq.write_table(table.slice(150), str(tmp_path / "part-1.parquet"))
    hf = datasets.Dataset.from_list(rows)
    return {
        "list": lambda: rows,
        "tuple": lambda: tuple(rows),
        "generator": lambda: (r for r in rows),
        "table": lambda: table,
        "reader": lambda: pa.RecordBatchReader.from_batches(table.schema, table.to_batches(max_chunksize=33)),
        "pyarrow dataset": lambda: pads.dataset([str(tmp_path / "part-0.parquet"), str(tmp_path / "part-1.parquet")]),
        "hf dataset": lambda: hf,
        "hf iterable": lambda: hf.to_iterable_dataset(num_shards=3),
        "hf generator": lambda: datasets.IterableDataset.from_generator(lambda: iter(rows), features=hf.features),
    }


@pytest.mark.parametrize("fmt", ["tar", "arrow"])
@pytest.mark.timeout(300)
def test_every_source_kind_gives_the_parquet_dataset(tmp_path, fmt):
    rows = _rows()
    sources = _sources(rows, tmp_path)
    opts = dict(format=fmt, length="tokens", shard_size=40_000)
    ref = tmp_path / "from-parquet"
    shardtool.pack(str(tmp_path / "rows.parquet"), str(ref), **opts)
    want = _version(ref)
    ds = shardtool.open_dataset(str(ref))
    got = list(ds)
    assert len(got) == len(rows) and ds.num_shards > 1
    for row, sample in zip(rows, got):
        assert sample["tokens"].tolist() == row["tokens"] and sample["text"] == row["text"]
        assert sample["n"] == row["n"] and bytes(sample["blob"]) == row["blob"] and sample["meta"] == row["meta"]
    for name, make in sources.items():
        out = tmp_path / name.replace(" ", "-")
        shardtool.pack(make(), str(out), **opts)
        assert _version(out) == want, name


@pytest.mark.timeout(120)
def test_tables_split_over_workers_and_streams_pack_in_one_process(tmp_path):
    rows = _rows(20_000, seed=3)
    table = pa.Table.from_pylist(rows)
    one = shardtool.pack(table, str(tmp_path / "w1"), format="arrow", length="tokens", shard_size=1 << 20)
    two = shardtool.pack(table, str(tmp_path / "w2"), format="arrow", length="tokens", shard_size=1 << 20, workers=2)
    shardtool.pack(table, str(tmp_path / "w2b"), format="arrow", length="tokens", shard_size=1 << 20, workers=2)
    assert one.samples == two.samples == len(rows)
    names = {
        s["path"].split("/")[1][:9] for s in shardtool.open_dataset(str(tmp_path / "w2")).manifest.to_dict()["shards"]
    }
    assert names == {"t0000-w00", "t0000-w01"}  # both workers packed rows
    assert _version(tmp_path / "w2") == _version(tmp_path / "w2b")
    k1 = [k for s in range(one.shards) for k in shardtool.open_dataset(str(tmp_path / "w1")).shard_index(s).keys]
    ds2 = shardtool.open_dataset(str(tmp_path / "w2"))
    assert k1 == [k for s in range(ds2.num_shards) for k in ds2.shard_index(s).keys]
    gen = shardtool.pack(
        (r for r in rows),
        str(tmp_path / "gen"),
        format="arrow",
        length="tokens",
        shard_size=1 << 20,
        workers=2,
        total=len(rows),
    )
    assert gen.samples == len(rows) and _version(tmp_path / "gen") == _version(tmp_path / "w1")


def _bad_rows():
    rows = [{"text": f"t{i}", "n": i} for i in range(10)]
    rows[3] = {"text": 7, "n": 3}
    rows[5] = "not a dict"
    rows[8] = {"text": "x"}
    return rows


@pytest.mark.parametrize("kind", ["list", "generator"])
def test_bad_rows_are_named_by_index(tmp_path, kind):
    rows = _bad_rows()
    make = (lambda: rows) if kind == "list" else (lambda: iter(rows))
    with pytest.raises(BadSampleError, match=r"row 3\).*'text'"):
        shardtool.pack(make(), str(tmp_path / "a"))
    assert not os.path.exists(tmp_path / "a" / "index.json")
    r = shardtool.pack(make(), str(tmp_path / "b"), skip_bad=True)
    assert r.samples == 7
    assert [s.split("(")[1].split(")")[0] for s in r.skipped] == ["row 3", "row 5", "row 8"]
    assert "expected a dict" in r.skipped[1] and "has fields ['text']" in r.skipped[2]
    keys = [k for k in shardtool.open_dataset(str(tmp_path / "b")).shard_index(0).keys]
    assert keys == [f"{i:09d}" for i in (0, 1, 2, 4, 6, 7, 9)]  # keys stay the rows' positions


def test_unsupported_objects_get_a_type_error_listing_what_is_accepted(tmp_path):
    for bad in (42, {"text": "a dict, not a list of them"}, [1, 2, 3], ["a.jsonl", {"x": 1}], iter([1, 2])):
        with pytest.raises(TypeError, match="Accepted: a path"):
            shardtool.pack(bad, str(tmp_path / "x"))
    assert not os.path.exists(tmp_path / "x" / "index.json")
    with pytest.raises(ShardtoolError, match="no sources"):
        shardtool.pack([], str(tmp_path / "x"))
    with pytest.raises(ShardtoolError, match="job-array"):
        shardtool.pack(iter([{"a": 1}]), str(tmp_path / "x"), num_tasks=2, task_index=0)


@pytest.mark.parametrize("fmt", ["tar", "arrow"])
def test_key_column_is_the_key_not_also_a_field(tmp_path, fmt):
    rows = [{"id": f"doc{i}", "text": f"text {i}", "tokens": list(range(1 + i % 7))} for i in range(50)]
    src = str(tmp_path / "in.parquet")
    pq.write_table(pa.Table.from_pylist(rows), src)
    shardtool.pack(src, str(tmp_path / "ds"), format=fmt, key="id", length="tokens")
    ds = shardtool.open_dataset(str(tmp_path / "ds"))
    assert ds.manifest.field_names == ["text", "tokens"]
    assert [s["__key__"] for s in ds] == [r["id"] for r in rows]
    if fmt == "tar":
        import tarfile

        with tarfile.open(ds.shard_path(0)) as tf:
            assert tf.getnames()[:2] == ["doc0.text", "doc0.tokens.npy"]
    # the same from dicts, and integer keys are their decimal text
    shardtool.pack(rows, str(tmp_path / "dicts"), format=fmt, key="id", length="tokens")
    assert _version(tmp_path / "dicts") == ds.version
    ints = [{"id": 10 * i, "text": "x"} for i in range(5)]
    shardtool.pack(pa.Table.from_pylist(ints), str(tmp_path / "ints"), format=fmt, key="id")
    assert [s["__key__"] for s in shardtool.open_dataset(str(tmp_path / "ints"))] == ["0", "10", "20", "30", "40"]
    with pytest.raises(BadSampleError, match="duplicate key 'a'"):
        shardtool.pack(
            [{"id": "a", "text": "1"}, {"id": "a", "text": "2"}], str(tmp_path / "dup"), format=fmt, key="id"
        )


def _first_has_tokens(rows):
    # Fields are inferred from the first sample, and an empty Python list says nothing about its
    # elements (JSON), while Parquet's column type does: give the first sample a token.
    return [{**rows[0], "tokens": rows[0]["tokens"] or [1]}] + rows[1:]


@settings(max_examples=15, deadline=None)
@given(
    st.lists(
        st.fixed_dictionaries(
            {
                "tokens": st.lists(st.integers(-(2**40), 2**40), max_size=12),
                "text": st.text(max_size=20),
                "blob": st.binary(max_size=30),
            }
        ),
        min_size=1,
        max_size=40,
    ).map(_first_has_tokens),
    st.sampled_from(["tar", "arrow"]),
)
def test_dicts_and_parquet_agree(tmp_path_factory, rows, fmt):
    tmp = tmp_path_factory.mktemp("agree")
    pq.write_table(pa.Table.from_pylist(rows), str(tmp / "in.parquet"))
    shardtool.pack(str(tmp / "in.parquet"), str(tmp / "pq"), format=fmt, samples_per_shard=7)
    shardtool.pack(rows, str(tmp / "dicts"), format=fmt, samples_per_shard=7)
    assert _version(tmp / "pq") == _version(tmp / "dicts")
