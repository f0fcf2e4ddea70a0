"""`shardtool pack LITDATA_DIR`: LitData optimize() output converted, read back equal to LitData's own
StreamingDataset row for row (plain, per-batch zstd and whole-chunk zstd), byte for byte as the same
rows packed from Parquet; unknown or unsafe serializers refused by name."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers.peers import peer_rows, run_peer
from shardtool.format import open_dataset
from shardtool.format.errors import BadSampleError
from shardtool.pack import pack


@pytest.fixture(scope="module", params=["none", "zstd", "zstd-chunk"])
def lit(request, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("lit") / f"lit-{request.param}")
    run_peer("litdata-write", root, request.param)
    # litdata's reader inflates whole-file zstd chunks in place: it reads a copy
    return root, peer_rows("litdata", shutil.copytree(root, root + "-read"), root + ".jsonl")


@pytest.mark.timeout(300)
def test_rows_read_back_equal_to_litdatas_reader(lit, tmp_path):
    root, rows = lit
    assert len(json.load(open(os.path.join(root, "index.json")))["chunks"]) > 3
    ds = open_dataset(pack(root, str(tmp_path / "ds"), workers=2).out)
    got = list(ds)
    assert len(got) == len(rows) == 120
    for g, r in zip(got, rows):
        assert list(g)[1:] == list(r)  # the item's keys, in its order
        for k, v in r.items():
            if isinstance(v, np.ndarray):
                assert g[k].dtype == v.dtype and np.array_equal(g[k], v), (g["__key__"], k)
            else:
                assert g[k] == v, (g["__key__"], k)


@pytest.mark.timeout(300)
def test_same_rows_as_parquet_give_the_same_dataset_byte_for_byte(lit, tmp_path):
    root, rows = lit
    table = pa.table(
        {
            "id": pa.array([r["id"] for r in rows], pa.int64()),
            "text": pa.array([r["text"] for r in rows], pa.string()),
            "tokens": pa.array([r["tokens"] for r in rows], pa.list_(pa.uint16())),
            "score": pa.array([r["score"] for r in rows], pa.float64()),
            "blob": pa.array([r["blob"] for r in rows], pa.binary()),
        }
    )
    pq.write_table(table, str(tmp_path / "rows.parquet"))
    a = pack(root, str(tmp_path / "a"), shard_size="1MiB", length="tokens")
    b = pack(str(tmp_path / "rows.parquet"), str(tmp_path / "b"), shard_size="1MiB", length="tokens")
    assert a.shards > 2
    names = ["index.json", "lengths.npy", "summaries.arrow"] + [
        f"shards/{n}" for n in sorted(os.listdir(os.path.join(a.out, "shards")))
    ]
    for name in names:
        assert open(os.path.join(a.out, name), "rb").read() == open(os.path.join(b.out, name), "rb").read(), name


def test_unknown_or_unsafe_serializers_and_damaged_chunks_are_named(lit, tmp_path):
    root = shutil.copytree(lit[0], str(tmp_path / "l"))
    path = os.path.join(root, "index.json")
    index = json.load(open(path))
    good = list(index["config"]["data_format"])
    for fmt, why in (("mystery", "not read"), ("pickle", "unpickling runs code")):
        index["config"]["data_format"][1] = fmt
        json.dump(index, open(path, "w"))
        with pytest.raises(BadSampleError, match=rf"index.json.*leaf 'text' has serializer '{fmt}'.*{why}"):
            pack(root, str(tmp_path / "out"))
    index["config"]["data_format"] = good
    json.dump(index, open(path, "w"))
    chunk = index["chunks"][3]["filename"]
    with open(os.path.join(root, chunk), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(root, chunk)) // 2)
    with pytest.raises(BadSampleError, match=chunk):
        pack(root, str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out" / "index.json")
