"""`shardtool upgrade`: a dataset packed before per-shard summaries existed gets them, in place,
without a new version; the loader then plans the same batches without a warning."""

from __future__ import annotations

import json
import os
import shutil
import warnings

import numpy as np
import pytest

from helpers.runcli import shardtool_cli
from helpers.s3server import s3_server  # noqa: F401  (fixture)
from shardtool.format import open_dataset
from shardtool.format.dataset import SummariesMissing
from shardtool.format.summaries import SUMMARIES_NAME
from shardtool.format.writer import summaries_bytes
from shardtool.loader import ShardedLoader
from test_loader_data import write_dataset

BATCHING = {"max_tokens": 120, "seed": 5}


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    return write_dataset(str(tmp_path_factory.mktemp("upgrade") / "d"), [23, 0, 31, 17, 29], seed=9)


def old_copy(root: str, dest: str) -> str:
    """The dataset as an older shardtool packed it: no summaries.arrow."""
    shutil.copytree(root, dest)
    os.remove(os.path.join(dest, SUMMARIES_NAME))
    return dest


def batches(root: str, world: int = 2, **kw) -> list[list[list[str]]]:
    out = []
    for r in range(world):
        ld = ShardedLoader(root, **BATCHING, rank=r, world_size=world, ranks_per_node=1, num_workers=0, **kw)
        out.append([list(b["__key__"]) for b in ld])
    return out


@pytest.mark.timeout(120)
def test_old_dataset_warns_plans_the_same_and_upgrade_removes_the_warning(packed, tmp_path):
    root, _ = packed
    old = old_copy(root, str(tmp_path / "old"))
    with open(os.path.join(old, "index.json"), "rb") as f:
        manifest = f.read()
    version = open_dataset(old).version
    with pytest.warns(SummariesMissing, match="shardtool upgrade"):
        # Without summaries the plan is computed from every length, as the version that packed it
        # planned (no weight sketch: node ranges cut shards pro rata).
        expected = batches(old)
        # A loader state saved before the upgrade must stay valid after it.
        ld = ShardedLoader(old, **BATCHING, rank=0, world_size=2, ranks_per_node=1, num_workers=0)
        it = iter(ld)
        next(it)
        state = ld.state_dict()
        it.close()

    check = shardtool_cli("upgrade", old, "--check")
    assert check.returncode == 1 and "needs an upgrade" in check.stderr and "no per-shard summaries" in check.stderr
    assert not os.path.exists(os.path.join(old, SUMMARIES_NAME)), "--check writes nothing"
    res = shardtool_cli("upgrade", old)
    assert res.returncode == 0, res.stderr
    assert "upgraded" in res.stdout and "index.json and the dataset version are unchanged" in res.stdout
    with open(os.path.join(old, "index.json"), "rb") as f:
        assert f.read() == manifest
    with open(os.path.join(old, SUMMARIES_NAME), "rb") as f:
        stored = f.read()
    ds = open_dataset(root)
    assert stored == summaries_bytes(ds.manifest, ds.lengths, sketch=False), "pack's file, less the sketch"
    assert open_dataset(old).summaries.sketch is None and ds.summaries.sketch is not None
    assert not [n for n in os.listdir(old) if n.startswith(".tmp-")], "no temp file left behind"
    with warnings.catch_warnings():
        warnings.simplefilter("error", SummariesMissing)
        assert open_dataset(old).version == version
        assert batches(old) == expected
        resumed = ShardedLoader(old, **BATCHING, rank=0, world_size=2, ranks_per_node=1, num_workers=0)
        resumed.load_state_dict(state)
        assert [list(b["__key__"]) for b in resumed] == expected[0][1:]
    again = shardtool_cli("upgrade", old, "--check", "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["needed"] is False
    assert "up to date" in shardtool_cli("upgrade", old).stdout


@pytest.mark.timeout(120)
def test_stale_summaries_are_replaced_and_a_broken_dataset_is_left_alone(packed, tmp_path):
    root, _ = packed
    other, _ = write_dataset(str(tmp_path / "other"), [23, 0, 31, 17, 29], seed=10)  # same shards, other lengths
    stale = str(tmp_path / "stale")
    shutil.copytree(root, stale)
    shutil.copy(os.path.join(other, SUMMARIES_NAME), os.path.join(stale, SUMMARIES_NAME))
    with pytest.warns(SummariesMissing, match="unusable per-shard summaries"):
        open_dataset(stale).summaries  # noqa: B018
    check = shardtool_cli("upgrade", stale, "--check", "--json")
    assert check.returncode == 1 and "stale" in json.loads(check.stdout)["reason"]
    assert shardtool_cli("upgrade", stale).returncode == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", SummariesMissing)
        got = open_dataset(stale).summaries
    assert np.array_equal(got.tokens, open_dataset(root).summaries.tokens)

    broken = old_copy(root, str(tmp_path / "broken"))
    lengths = os.path.join(broken, "lengths.npy")
    data = bytearray(open(lengths, "rb").read())
    data[-1] ^= 0x01
    open(lengths, "wb").write(bytes(data))
    res = shardtool_cli("upgrade", broken)
    assert res.returncode == 1 and "lengths.npy" in res.stderr and "hash" in res.stderr, res.stderr
    assert not os.path.exists(os.path.join(broken, SUMMARIES_NAME))
    missing = shardtool_cli("upgrade", str(tmp_path / "nowhere"))
    assert missing.returncode == 1 and "does not exist" in missing.stderr


@pytest.mark.timeout(180)
def test_upgrade_on_a_real_s3_api_server(packed, tmp_path, s3_server):  # noqa: F811
    root, _ = packed
    old = old_copy(root, str(tmp_path / "old"))
    url = s3_server.upload(old, "upgrade-test/ds")
    ep = s3_server.endpoint
    opts = [
        "-o",
        "key=testing",
        "-o",
        "secret=testing",
        "-o",
        f"client_kwargs.endpoint_url={ep}",
        "-o",
        "client_kwargs.region_name=us-east-1",
    ]
    version = open_dataset(url, storage_options=s3_server.storage_options).version
    check = shardtool_cli("upgrade", url, "--check", *opts)
    assert check.returncode == 1, check.stderr
    res = shardtool_cli("upgrade", url, "--json", *opts)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["needed"] and report["written"].endswith(SUMMARIES_NAME) and report["version"] == version
    fs = s3_server.fs()
    local = open_dataset(root)
    assert fs.cat_file(f"upgrade-test/ds/{SUMMARIES_NAME}") == summaries_bytes(
        local.manifest, local.lengths, sketch=False
    )
    with pytest.warns(SummariesMissing):
        before = batches(old)  # the plan before the upgrade: from every length
    with warnings.catch_warnings():
        warnings.simplefilter("error", SummariesMissing)
        ds = open_dataset(url, storage_options=s3_server.storage_options)
        assert ds.version == version and ds.summaries.num_shards == ds.num_shards
        assert batches(url, storage_options=s3_server.storage_options) == before
