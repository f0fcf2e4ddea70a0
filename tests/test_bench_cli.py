"""`shardtool bench`: real rank processes, a peer in the same run, JSON and plot outputs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_bench_generates_compares_and_writes_json_and_plot(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    cp = subprocess.run(
        [sys.executable, "-m", "shardtool", "bench", "--generate", "3000", "--ranks", "2", "--workers", "0,1",
         "--max-tokens", "4096", "--max-batches", "10", "--step-ms", "2", "--compare", "webdataset",
         "--json", str(out_json), "--plot", str(out_png)],
        env=env, capture_output=True, text=True, timeout=280)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    report = json.loads(out_json.read_text())
    rows = {(r["reader"], r["num_workers"]): r for r in report["rows"]}
    assert set(rows) == {("shardtool", 0), ("shardtool", 1), ("webdataset", 0), ("webdataset", 1)}
    for r in rows.values():
        assert not r["errors"] and r["batches_per_rank"] == [10, 10]
        assert r["samples_per_s"] > 0 and 0.0 <= r["wait_fraction"] <= 1.0
    assert rows[("shardtool", 0)]["padding_efficiency"] > 0.9
    for w in (0, 1):  # shardtool's numbers are the loader's own metrics, carried whole in the JSON
        r = rows[("shardtool", w)]
        per_rank = r["loader_per_rank"]
        assert [m["rank"] for m in per_rank] == [0, 1]
        assert all(m["window"]["batches"] == 9 for m in per_rank)  # after the first batch, as the harness times
        wait = [m["window"]["wait_s"] / m["window"]["seconds"] for m in per_rank]
        assert r["wait_fraction"] == pytest.approx(sum(wait) / 2)
        assert r["loader"]["bytes_read"]["local"] > 0 and r["read_mb_per_s"] > 0
        assert r["loader"]["worker_restarts"] == 0
    assert rows[("webdataset", 1)]["loader"] is None
    assert {x["num_workers"] for x in report["ratios"]} == {0, 1}
    assert "shardtool / webdataset samples/s at num_workers=0" in cp.stdout
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_refuses_an_unknown_peer(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cp = subprocess.run([sys.executable, "-m", "shardtool", "bench", "--generate", "200", "--compare", "nope",
                         "--step-ms", "1"], env=env, capture_output=True, text=True, timeout=120)
    assert cp.returncode == 2 and "unknown peer 'nope'" in cp.stderr
