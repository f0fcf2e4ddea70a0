"""Cross-rank metrics under torchrun (4 ranks, gloo): the summary and `shardtool stats` name the slow rank.

One rank reads through a slow fsspec source (tests/helpers/ddp_metrics_worker.py); the others are fast
but wait for it in the per-step all-reduce, as DDP ranks do. The loader's all-gather every N
steps must name that rank and its node, and the merged JSONL files of both simulated nodes must
say the same in `shardtool stats`, its JSON and its plot.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers.runcli import shardtool_cli
from helpers.s3server import free_port
from test_loader_data import write_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "helpers", "ddp_metrics_worker.py")
SLOW = 2
EVERY = 5


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    base = tmp_path_factory.mktemp("ddp-metrics")
    data, _ = write_dataset(str(base / "d"), [40, 35, 50, 30], seed=2)
    out = str(base / "out")
    os.makedirs(out)
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc_per_node=4",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        WORKER,
        "--data",
        data,
        "--out",
        out,
        "--slow-rank",
        str(SLOW),
        "--every",
        str(EVERY),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=150)
    assert res.returncode == 0, res.stderr[-4000:]
    recs = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(4)]
    return out, recs, res.stdout + res.stderr


@pytest.mark.timeout(200)
def test_the_cross_rank_summary_names_the_slow_rank_and_its_node(job):
    out, recs, log = job
    for rec in recs:  # every rank holds the same summary, gathered at the same step
        s = rec["summary"]
        assert s["slowest_rank"] == SLOW and s["slowest_node"] == SLOW // 2
        assert s == recs[0]["summary"]
        assert s["wait_fraction"]["max"] == s["slowest_wait_fraction"] > s["wait_fraction"]["median"]
    assert f"slowest rank {SLOW} on node {SLOW // 2}" in log  # logged by rank 0
    assert log.count("shardtool.loader.metrics: loader step") == recs[0]["metrics"]["step"] // EVERY
    lines = [json.loads(x) for x in open(recs[0]["path"])]
    assert all(x["ranks"]["slowest_rank"] == SLOW for x in lines)  # rank 0's lines carry it too


@pytest.mark.timeout(200)
def test_stats_merges_both_nodes_and_names_the_slow_rank(job, tmp_path):
    out, recs, _ = job
    nodes = [os.path.join(out, "metrics", f"node{n}") for n in range(2)]
    assert sorted(os.listdir(nodes[1])) == sorted(os.path.basename(recs[r]["path"]) for r in (2, 3))
    cp = shardtool_cli("stats", *nodes, "--plot", str(tmp_path / "s.png"))
    assert cp.returncode == 0, cp.stderr
    text = cp.stdout
    assert "4 rank(s) on 2 node(s)" in text
    slowest = text.split("slowest ranks")[1].strip().splitlines()
    assert slowest[1].strip().startswith(f"rank {SLOW} (node {SLOW // 2},")
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    cp = shardtool_cli("stats", *nodes, "--json")
    assert cp.returncode == 0, cp.stderr
    s = json.loads(cp.stdout)
    assert [r["rank"] for r in s["ranks"]] == [0, 1, 2, 3] and [n["ranks"] for n in s["nodes"]] == [2, 2]
    assert s["slowest"][0]["rank"] == SLOW
    for r in s["ranks"]:  # the merged totals are each rank's last cumulative line
        last = recs[r["rank"]]["metrics"]["step"] // EVERY * EVERY
        assert r["steps"] == last
        assert r["bytes_read.local" if r["rank"] != SLOW else "bytes_read.remote"] > 0
    assert s["nodes"][1]["tokens"] == s["ranks"][2]["tokens"] + s["ranks"][3]["tokens"]


def test_stats_says_what_is_missing(job, tmp_path):
    cp = shardtool_cli("stats", str(tmp_path))
    assert cp.returncode == 2 and "no loader metric lines" in cp.stderr
    out = os.path.join(job[0], "metrics")
    cp = shardtool_cli("stats", out, "--run", "nope")
    assert cp.returncode == 2 and "run 'nope' is not in these files; runs found: " in cp.stderr
    cp = shardtool_cli("stats", out, "--json", str(tmp_path / "s.json"))
    assert cp.returncode == 0 and "per node" in cp.stdout and json.loads((tmp_path / "s.json").read_text())["ranks"]
