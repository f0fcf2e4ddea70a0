"""`shardtool pack MDS_DIR`: a MosaicML Streaming dataset converted, read back equal to Streaming's own
reader row for row (plain and zstd shards), byte for byte as the same rows packed from Parquet."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers.peers import peer_rows, run_peer
from shardtool.format import open_dataset
from shardtool.format.errors import BadSampleError
from shardtool.pack import pack


@pytest.fixture(scope="module", params=["none", "zstd"])
def mds(request, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("mds") / f"mds-{request.param}")
    run_peer("mds-write", root, request.param)
    rows = peer_rows("mds", root, root + ".jsonl")
    return root, rows


def equal(a, b) -> bool:
    if isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(b, np.floating):
        return float(a) == float(b)
    return a == b


@pytest.mark.timeout(300)
def test_rows_read_back_equal_to_streamings_reader(mds, tmp_path):
    root, rows = mds
    index = json.load(open(os.path.join(root, "index.json")))
    assert len(index["shards"]) > 3  # several shards, each with a recorded sha1 and xxh64
    ds = open_dataset(pack(root, str(tmp_path / "ds"), workers=2).out)
    got = list(ds)
    assert len(got) == len(rows) == 120
    for g, r in zip(got, rows):
        assert set(g) - {"__key__"} == set(r)
        assert all(equal(g[k], r[k]) for k in r), g["__key__"]
    assert ds.manifest.fields[ds.manifest.field_names.index("tokens")].dtype == "u2"


@pytest.mark.timeout(300)
def test_same_rows_as_parquet_give_the_same_dataset_byte_for_byte(mds, tmp_path):
    root, rows = mds
    table = pa.table(
        {
            "blob": pa.array([r["blob"] for r in rows], pa.binary()),
            "id": pa.array([r["id"] for r in rows], pa.int64()),
            "meta": pa.array([r["meta"] for r in rows]),
            "score": pa.array([r["score"] for r in rows], pa.float32()),
            "text": pa.array([r["text"] for r in rows], pa.string()),
            "tokens": pa.array(list(r["tokens"] for r in rows), pa.list_(pa.uint16())),
        }
    )
    pq.write_table(table, str(tmp_path / "rows.parquet"))
    a = pack(root, str(tmp_path / "a"), shard_size="1MiB", length="tokens")
    b = pack(str(tmp_path / "rows.parquet"), str(tmp_path / "b"), shard_size="1MiB", length="tokens")
    assert a.shards > 2
    for name in sorted(os.listdir(a.out)) + [f"shards/{n}" for n in sorted(os.listdir(os.path.join(a.out, "shards")))]:
        p = os.path.join(a.out, name)
        if os.path.isfile(p):
            assert open(p, "rb").read() == open(os.path.join(b.out, name), "rb").read(), name


def _copy(root: str, dst: str) -> str:
    import shutil

    shutil.copytree(root, dst)
    return dst


def test_a_shard_whose_hash_does_not_match_its_index_is_named(mds, tmp_path):
    root = _copy(mds[0], str(tmp_path / "m"))
    index = json.load(open(os.path.join(root, "index.json")))
    shard = index["shards"][2]
    name = (shard["zip_data"] or shard["raw_data"])["basename"]
    with open(os.path.join(root, name), "r+b") as f:
        f.seek(200)
        b = f.read(1)
        f.seek(200)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(BadSampleError, match=rf"{name}.*(sha1|xxh64) hash .* does not match index.json"):
        pack(root, str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out" / "index.json")
    r = pack(root, str(tmp_path / "skip"), skip_bad=True)  # --skip-bad: that shard is left out, named
    assert r.samples == 120 - shard["samples"] and name in r.skipped[0]


def test_unsafe_or_unknown_columns_and_wrong_counts_are_refused(mds, tmp_path):
    root = _copy(mds[0], str(tmp_path / "m"))
    path = os.path.join(root, "index.json")
    index = json.load(open(path))
    for s in index["shards"]:
        s["column_encodings"][s["column_names"].index("meta")] = "pkl"
    json.dump(index, open(path, "w"))
    with pytest.raises(BadSampleError, match="column 'meta' \\(pkl\\): pickled objects are refused"):
        pack(root, str(tmp_path / "out"))
    for s in index["shards"]:
        s["column_encodings"][s["column_names"].index("meta")] = "json"
    index["shards"][1]["samples"] += 1
    json.dump(index, open(path, "w"))
    with pytest.raises(BadSampleError, match=r"holds \d+ samples, index.json says \d+"):
        pack(root, str(tmp_path / "out"))
