"""Random access (issue 35 item 3): ``shardtool.open(url)`` gives ``len(ds)``, ``ds[i]`` by global
index, slices and ``ds.get(key)``, each reading that sample's byte range (an Arrow shard: its
record batch), locally and over a real S3 API; bad indices and unknown keys say so. Real data:
stdlib files as text, keyed by their path."""

from __future__ import annotations

import os

import numpy as np
import pytest

import shardtool
from helpers.realtext import stdlib_files
from helpers.s3server import s3_server  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module", params=["tar", "arrow"])
def packed(request, tmp_path_factory):
    paths = stdlib_files(150)
    rows = [
        {
            "name": os.path.relpath(p, os.path.dirname(paths[0])).replace("/", "_").replace(".", "_"),
            "text": open(p).read(),
        }
        for p in paths
    ]
    root = str(tmp_path_factory.mktemp(f"ra-{request.param}") / "ds")
    shardtool.pack(rows, root, format=request.param, key="name", shard_size=1_000_000)
    return root, rows


def test_len_index_negative_index_and_slices_match_the_dataset_order(packed):
    root, rows = packed
    ds = shardtool.open(root)
    assert ds.num_shards > 2 and len(ds) == len(rows)
    every = list(ds)  # the dataset's own order, shard by shard
    for i in np.random.default_rng(0).choice(len(ds), 25, replace=False).tolist() + [0, len(ds) - 1]:
        assert ds[i] == every[i]
    assert ds[-1] == every[-1] and ds[-len(ds)] == every[0]
    assert ds[10:17] == every[10:17] and ds[::40] == every[::40] and ds[5:5] == []
    assert [s["text"] for s in every] == [r["text"] for r in rows]  # packed in order: the same samples


def test_get_by_key_and_errors_that_name_what_is_missing(packed):
    root, rows = packed
    ds = shardtool.open(root)
    for r in rows[::30] + [rows[-1]]:
        got = ds.get(r["name"])
        assert got["__key__"] == r["name"] and got["text"] == r["text"]
        assert ds[ds.locate_key(r["name"])] == got
    with pytest.raises(KeyError, match="no sample has key 'nope'"):
        ds.get("nope")
    with pytest.raises(IndexError, match=f"sample {len(ds)} is out of range: .* has {len(ds)} samples"):
        ds[len(ds)]
    with pytest.raises(IndexError, match="out of range"):
        ds[-len(ds) - 1]
    with pytest.raises(TypeError, match="indexed by an int or a slice"):
        ds["0"]


def test_over_s3_the_same_samples(packed, s3_server):  # noqa: F811
    root, rows = packed
    url = s3_server.upload(root, f"randomaccess/{os.path.basename(os.path.dirname(root))}")
    remote = shardtool.open(url, storage_options=s3_server.storage_options)
    local = shardtool.open(root)
    assert len(remote) == len(local)
    for i in (0, 7, len(local) // 2, -1):
        assert remote[i] == local[i]
    assert remote.get(rows[42]["name"])["text"] == rows[42]["text"]
