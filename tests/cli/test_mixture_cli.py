"""`shardtool plan mix.json` and `shardtool warm mix.json`, run as a user runs them."""

from __future__ import annotations

import json
import os

import pytest

from helpers.runcli import shardtool_cli
from shardtool import cache
from shardtool.format import open_dataset
from shardtool.plan import DataLayout, Layout, shards_for_node
from test_loader_data import write_dataset

pytestmark = pytest.mark.timeout(180)
SHARDS = {"web": [90, 60, 80, 70, 50, 40], "code": [40, 30, 50], "math": [30, 20, 25]}


@pytest.fixture
def mix(tmp_path):
    sources = {}
    for i, (name, shards) in enumerate(SHARDS.items()):
        root, _ = write_dataset(str(tmp_path / name), shards, seed=i, prefix=name[0])
        sources[name] = {"url": name, "weight": {"web": 0.6, "code": 0.3, "math": 0.1}[name]}  # relative to the file
    path = tmp_path / "mix.json"
    path.write_text(json.dumps({"sources": sources, "max_repeat": 8}))
    return str(path)


def test_plan_prints_every_sources_share_tokens_epochs_and_bytes_per_node(mix, tmp_path):
    res = shardtool_cli("plan", mix, "--steps", "150", "--nodes", "2", "--max-tokens", "160", "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["steps"] == 150 and report["refused"] is None and list(report["sources"]) == ["web", "code", "math"]
    for name, s in report["sources"].items():
        assert abs(s["weight_share"] - {"web": 0.6, "code": 0.3, "math": 0.1}[name]) < 1e-9
        assert abs(s["realized_share"] - s["weight_share"]) < 0.02  # one batch of one source a step
        assert s["tokens"] > 0 and 0 < s["source_epochs"] <= s["source_epochs_begun"] <= 8
        ds = open_dataset(str(tmp_path / name))
        per_node = [
            sum(ds.manifest.shards[i].bytes for i in shards_for_node(ds.summaries, DataLayout.pure_dp(Layout(2, 1)), n))
            for n in range(2)
        ]
        assert s["bytes_per_node"]["max"] == max(per_node) and s["bytes_per_node"]["min"] == min(per_node)
    text = shardtool_cli("plan", mix, "--steps", "150", "--nodes", "2", "--max-tokens", "160")
    assert text.returncode == 0, text.stderr
    lines = {line.split()[0]: line for line in text.stdout.splitlines() if line.startswith("  ")}
    assert {"web", "code", "math"} <= set(lines) and "0.6000" in lines["web"]


def test_plan_refuses_a_span_past_max_repeat_with_the_table(mix):
    res = shardtool_cli("plan", mix, "--steps", "5000", "--max-tokens", "160")
    assert res.returncode == 1
    assert "more than max_repeat=8 times" in res.stderr and "tokens needed" in res.stderr
    assert "> max_repeat" in res.stderr
    assert shardtool_cli("plan", mix, "--max-tokens", "160").returncode == 1  # no length: refused
    one = shardtool_cli("plan", os.path.join(os.path.dirname(mix), "web"), "--steps", "5", "--max-tokens", "160")
    assert one.returncode == 1 and "--steps and --tokens give the length of a mixture" in one.stderr


def test_warm_warms_every_sources_node_range_in_one_call(mix, tmp_path):
    cdir = str(tmp_path / "node1" / "cache")
    os.makedirs(os.path.dirname(cdir))
    res = shardtool_cli("warm", mix, "--cache-dir", cdir, "--nodes", "2", "--node-rank", "1", "-q", "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["status"] == "ok" and list(report["sources"]) == ["web", "code", "math"]
    for name in SHARDS:
        assert f"source '{name}': warm ok" in res.stderr
        dc = cache.open_cache(str(tmp_path / name), cdir)
        mine = set(shards_for_node(dc.dataset.summaries, DataLayout.pure_dp(Layout(2, 1)), 1))
        assert {i for i in range(len(SHARDS[name])) if dc.is_cached(i)} == mine
        assert report["sources"][name]["assigned"] == len(mine)


def test_a_missing_source_is_a_usage_error_after_the_others_are_warmed(mix, tmp_path):
    body = json.loads(open(mix).read())
    body["sources"]["gone"] = {"url": "no-such-dataset", "weight": 0.1}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(body))
    cdir = str(tmp_path / "cache")
    res = shardtool_cli("warm", str(bad), "--cache-dir", cdir, "-q")
    assert res.returncode == 2
    assert "source 'gone'" in res.stderr and "no dataset at" in res.stderr
    assert "source 'math': warm ok" in res.stderr


def test_a_budget_never_lets_one_source_evict_anothers_shards(mix, tmp_path):
    cdir = str(tmp_path / "cache")
    total = sum(open_dataset(str(tmp_path / n)).manifest.num_bytes for n in SHARDS)
    res = shardtool_cli("warm", mix, "--cache-dir", cdir, "--max-bytes", str(total - 1), "-q", "--json")
    assert res.returncode == 3, res.stderr  # this node cannot hold all its shards: a local fault
    report = json.loads(res.stdout)
    assert report["sources"]["web"]["status"] == "ok" and report["sources"]["web"]["evicted_shards"] == 0
    failed = [n for n, r in report["sources"].items() if r["status"] == "local_fault"]
    assert failed and f"source '{failed[0]}'" in res.stderr
    web = cache.open_cache(str(tmp_path / "web"), cdir)
    assert all(web.is_cached(i) for i in range(len(SHARDS["web"])))  # what was warmed stays warmed
    again = shardtool_cli("warm", mix, "--cache-dir", cdir, "--max-bytes", str(total), "-q")
    assert again.returncode == 0, again.stderr
