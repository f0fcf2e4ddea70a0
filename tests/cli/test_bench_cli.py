"""`shardtool bench`: real rank processes, a peer in the same run, JSON and plot outputs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_bench_generates_compares_and_writes_json_and_plot(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    cp = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardtool",
            "bench",
            "--generate",
            "3000",
            "--ranks",
            "2",
            "--workers",
            "0,1",
            "--max-tokens",
            "8192",
            "--max-batches",
            "10",
            "--step-ms",
            "2",
            "--compare",
            "webdataset",
            "--json",
            str(out_json),
            "--plot",
            str(out_png),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
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
    cp = subprocess.run(
        [sys.executable, "-m", "shardtool", "bench", "--generate", "200", "--compare", "nope", "--step-ms", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cp.returncode == 2 and "unknown peer 'nope'" in cp.stderr


def _session_procs(sid: int) -> list[int]:
    """Live processes of session ``sid`` (the bench and every rank and worker it started)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                fields = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                out.append(int(d))
    return out


def _bench(args, env, timeout):
    """Run `shardtool bench ARGS` in its own session; on timeout kill all of it, then fail."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardtool", "bench", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        for pid in _session_procs(proc.pid):
            os.kill(pid, 9)
        out, err = proc.communicate()
        pytest.fail(f"shardtool bench {' '.join(args)} hung for {timeout} s\n{out}\n{err[-3000:]}")
    return proc, out, err


@pytest.mark.timeout(400)
def test_bench_in_its_documented_form_does_not_hang(tmp_path):
    # No --step-ms: the step is timed with a tiny model in the parent (intra-op threads > 1 where
    # the machine has 2+ cores), and ranks must not inherit that used OpenMP pool.
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.pop(var, None)
    out_json = tmp_path / "out.json"
    proc, out, err = _bench(
        [
            "--generate",
            "3000",
            "--ranks",
            "2",
            "--workers",
            "0",
            "--max-batches",
            "6",
            "--compare",
            "webdataset",
            "--json",
            str(out_json),
            "--timeout",
            "150",
        ],
        env,
        330,
    )
    assert proc.returncode == 0, out + err
    assert "measured tiny-model step" in err
    rows = json.loads(out_json.read_text())["rows"]
    assert {r["reader"] for r in rows} == {"shardtool", "webdataset"}
    assert all(not r["errors"] and r["batches_per_rank"] == [6, 6] for r in rows), rows


@pytest.mark.timeout(200)
def test_a_hung_rank_is_killed_at_the_timeout_and_named(tmp_path):
    from shardtool.benchmarks.node import generate_token_dataset
    from shardtool.format import open_dataset

    url = generate_token_dataset(str(tmp_path / "ds"), 400, samples_per_shard=100)
    stuck = open_dataset(url).shard_path(0)
    os.unlink(stuck)
    os.mkfifo(stuck)  # opening it blocks forever, like a read from a hung filesystem
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    began = time.monotonic()
    proc, out, err = _bench([url, "--ranks", "2", "--workers", "0,2", "--step-ms", "1", "--timeout", "10"], env, 150)
    assert proc.returncode == 1, out + err
    for workers in (0, 2):
        for rank in (0, 1):
            assert f"shardtool (workers={workers}) failed: shardtool rank {rank}/2: timed out" in err, err
    assert time.monotonic() - began < 120
    deadline = time.monotonic() + 10  # multiprocessing's resource tracker exits once the bench has
    while _session_procs(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {p: open(f"/proc/{p}/cmdline").read().replace("\0", " ") for p in _session_procs(proc.pid)}
    assert not left, left  # no rank or worker left behind


@pytest.mark.timeout(400)
def test_bench_as_documented_is_bounded_and_says_first_how_long_it_takes(tmp_path):
    # `shardtool bench --generate 20000 --json out.json --plot out.png`, as its --help shows it: no
    # --step-ms, no --max-batches. With a whole epoch per run at the measured CPU step (~0.6 s on 2
    # cores) it used to take about 20 minutes; by default a run now stops after ~20 s of steps.
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.pop(var, None)
    out_json, out_png = tmp_path / "out.json", tmp_path / "out.png"
    began = time.monotonic()
    proc, out, err = _bench(["--generate", "20000", "--json", str(out_json), "--plot", str(out_png)], env, 360)
    took = time.monotonic() - began
    assert proc.returncode == 0, out + err
    estimate = re.search(r"^estimate: .* about (\d+) s in all", err, re.M)
    assert estimate, err
    assert took < 180, f"the documented bench took {took:.0f} s"
    assert float(estimate.group(1)) / 3 < took < 3 * float(estimate.group(1)) + 60, (took, estimate.group(0))
    rows = json.loads(out_json.read_text())["rows"]
    assert [r["num_workers"] for r in rows] == [0, 2] and not any(r["errors"] for r in rows), rows
    bound = rows[0]["max_batches"]
    assert bound >= 20 and all(r["batches_per_rank"] == [bound, bound] for r in rows), rows
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(200)
def test_peak_rss_is_each_rank_s_own_not_the_bench_process_s(tmp_path):
    # The bench process measures the step with a real model (and a peer's copy is written there)
    # before it spawns the ranks: with rusage's ru_maxrss, which Linux carries across exec, every
    # rank of every reader reported that process's peak, one figure for the whole table.
    import numpy as np

    from shardtool.benchmarks.node import BenchConfig, generate_token_dataset, run_node
    from shardtool.cli._plan import peak_rss_mb

    url = generate_token_dataset(str(tmp_path / "ds"), 2000, samples_per_shard=500)
    ballast = np.ones(1 << 30, np.uint8)  # 1 GiB, every page touched: this process's peak, not a rank's
    here = peak_rss_mb()
    try:
        (result,) = run_node("shardtool", BenchConfig(url, ranks=1, num_workers=0, max_batches=3), timeout=150)
    finally:
        del ballast
    assert result.error is None and result.batches == 3, result
    assert 0 < result.peak_rss_mb < here - 512, (result.peak_rss_mb, here)
