"""verify: catches a flipped byte and a truncated shard, naming each bad shard, exit 1."""

from __future__ import annotations

import json
import os

import pytest

import shardtool
from helpers.data_gen import image_samples, token_records, write_jsonl, write_tree
from helpers.fsutil import flip_byte
from helpers.runcli import shardtool_cli as _cli
from shardtool.pack.verify import verify


def _packed(tmp_path, fmt: str) -> str:
    """200 token records in shards of 50, as ``fmt``."""
    out = str(tmp_path / "o")
    shardtool.pack(
        write_jsonl(str(tmp_path / "in.jsonl"), token_records(200)),
        out,
        format=fmt,
        samples_per_shard=50,
        length="tokens",
    )
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["tar", "arrow"])
def test_verify_flipped_byte_and_truncation(tmp_path, fmt):
    out = _packed(tmp_path, fmt)
    assert verify(out)["ok"]
    assert verify("file://" + out)["ok"]
    p = _cli("verify", out)
    assert p.returncode == 0 and "OK" in p.stdout
    shards = [s.path for s in shardtool.open_dataset(out).manifest.shards]
    flip, trunc = os.path.join(out, shards[1]), os.path.join(out, shards[3])
    flip_byte(flip, 700, 0x01)
    with open(trunc, "r+b") as f:
        f.truncate(os.path.getsize(trunc) - 100)
    rep = verify(out)
    assert not rep["ok"] and sorted(b["shard"] for b in rep["bad"]) == sorted([shards[1], shards[3]])
    p = _cli("verify", out)
    assert p.returncode == 1
    assert shards[1] in p.stderr and shards[3] in p.stderr and "truncated" in p.stderr
    p = _cli("verify", out, "--json")
    assert p.returncode == 1 and len(json.loads(p.stdout)["bad"]) == 2


@pytest.mark.timeout(60)
def test_verify_catches_index_that_disagrees_with_shard(tmp_path):
    out = str(tmp_path / "o")
    shardtool.pack(write_tree(str(tmp_path / "t"), image_samples(10)), out)
    ds = shardtool.open_dataset(out)
    idx = os.path.join(out, ds.manifest.shards[0].index)
    flip_byte(idx, 200)
    rep = verify(out)
    assert not rep["ok"] and rep["bad"][0]["shard"] == ds.manifest.shards[0].path


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["tar", "arrow"])
def test_verify_names_a_cut_lengths_or_summaries_file_once_as_itself(tmp_path, fmt):
    """A truncated lengths.npy was reported as every shard's fault but one (each shard's index is
    checked against it); a truncated summaries.arrow gave "verify: OK"."""
    out = _packed(tmp_path, fmt)
    for name in ("lengths.npy", "summaries.arrow"):
        path = os.path.join(out, name)
        whole = open(path, "rb").read()
        with open(path, "wb") as f:
            f.write(whole[: len(whole) // 2])
        rep = verify(out)
        assert not rep["ok"] and [b["shard"] for b in rep["bad"]] == [name], rep["bad"]
        p = _cli("verify", out)
        assert p.returncode == 1 and f"BAD {name}" in p.stderr and "1 bad" in p.stdout, (p.stdout, p.stderr)
        with open(path, "wb") as f:
            f.write(whole)
    assert verify(out)["ok"]
