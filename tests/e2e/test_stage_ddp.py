"""In-job staging with real processes: 2 ranks on gloo, each with 2 DataLoader workers, on a dataset
with the real, heavy-tailed lengths of the stdlib's files (tests/helpers/realtext.py). Staged in the job
(local rank 0's stager, or `shardtool warm --follow` beside the ranks), the job trains exactly the
batches of a prolog-warmed cache and of no cache at all, and no shard is fetched twice."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from helpers.cachedata import child_env
from helpers.realtext import stdlib_lengths
from shardtool.cache import warm
from shardtool.plan import Layout, Placement
from test_loader_data import write_dataset

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(TESTS, "helpers", "stage_worker.py")
SHARDS = 16


def worker_env(run: str) -> dict:
    env = {k: v for k, v in child_env().items() if not k.startswith(("TORCHELASTIC_", "GROUP_", "ROLE_", "SHARDTOOL_"))}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", SHARDTOOL_STAGE_RUN=run)
    return env


def job(out: str, argv: list[str]) -> dict:
    return {"world": 2, "out": out, "limit": 120, "argv": argv, "env": {"LOCAL_WORLD_SIZE": "2"}}


def forked(jobs: list[dict], base: str, run: str, timeout: float = 280) -> None:
    path = os.path.join(base, f"jobs-{run}.json")
    with open(path, "w") as f:
        json.dump(jobs, f)
    res = subprocess.run(
        [sys.executable, WORKER, path],
        env=worker_env(run),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    for j, line in zip(jobs, map(json.loads, res.stdout.splitlines())):
        logs = "\n".join(read(p)[-2000:] for p in glob.glob(os.path.join(j["out"], "rank*.log")))
        assert all(rc == 0 for rc, _ in line["ranks"]), f"{j['out']}: {line['ranks']}\n{logs}"


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def records(out: str) -> list[dict]:
    return [json.loads(read(os.path.join(out, f"rank{r}.json"))) for r in range(2)]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    lengths = np.minimum(stdlib_lengths(), 4096)[: SHARDS * 40]
    root, _ = write_dataset(str(tmp_path_factory.mktemp("stage") / "src"), [40] * SHARDS, lengths=lengths, extra=False)
    return root


def stager_reports(cache_dir: str) -> list[dict]:
    return [json.loads(read(p)) for p in glob.glob(os.path.join(cache_dir, "stage", "*", "stager-*.json"))]


def shard_bytes(cache_dir: str) -> int:
    return sum(os.path.getsize(p) for p in glob.glob(os.path.join(cache_dir, "*", "shard-*.tar")))


@pytest.mark.timeout(300)
def test_in_job_staging_trains_the_batches_of_a_warmed_cache_and_of_no_cache(dataset, tmp_path):
    warmed = str(tmp_path / "warmed")
    report = warm(dataset, warmed, placement=Placement(Layout(1, 2), 0), progress=False)  # what a prolog does
    assert report.status == "ok", report.error
    staged = str(tmp_path / "staged")
    slow = json.dumps({"latency": 0.01})  # a remote source: each fetch stays in flight a while
    jobs = [
        job(str(tmp_path / "none"), ["--data", dataset]),
        job(str(tmp_path / "warm"), ["--data", dataset, "--cache-dir", warmed]),
        job(
            str(tmp_path / "stage"),
            ["--data", "faulty://" + dataset, "--cache-dir", staged, "--stage", "on", "--options", slow],
        ),
    ]
    forked(jobs, str(tmp_path), "ddp")
    none, warm_, stage = (records(j["out"]) for j in jobs)
    for r in range(2):
        assert len(none[r]["keys"]) > 10
        assert warm_[r]["keys"] == none[r]["keys"], f"rank {r}: a warmed cache trained other batches"
        assert stage[r]["keys"] == none[r]["keys"], f"rank {r}: in-job staging trained other batches"
    assert sum(rec["cache"]["misses"] for rec in warm_) == 0
    # No shard fetched twice: the stager's copies and the ranks' own fetches add up to the cache.
    reports = stager_reports(staged)
    assert len(reports) == 1 and reports[0]["shards_copied"] > 0, reports
    fetched = reports[0]["bytes_copied"] + sum(rec["cache"]["fetch_bytes"] for rec in stage)
    assert fetched == shard_bytes(staged), (reports[0], [rec["cache"] for rec in stage])


@pytest.mark.timeout(300)
def test_a_warm_follow_step_beside_the_ranks_stages_for_them(dataset, tmp_path):
    staged = str(tmp_path / "follow")
    env = worker_env("follow")
    stager = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shardtool",
            "warm",
            dataset,
            "--cache-dir",
            staged,
            "--follow",
            "--ranks-per-node",
            "2",
            "--ahead",
            "4",
            "-j",
            "2",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out = str(tmp_path / "external")
        forked([job(out, ["--data", dataset, "--cache-dir", staged, "--stage", "external"])], str(tmp_path), "follow")
        _, err = stager.communicate(timeout=60)
    finally:
        if stager.poll() is None:
            stager.kill()
            stager.wait()
    assert stager.returncode == 0, err
    assert "shardtool warm --follow: staged" in err and ("(done)" in err or "(closed)" in err), err
    reference = str(tmp_path / "ref")
    forked([job(reference, ["--data", dataset])], str(tmp_path), "ref")
    assert [r["keys"] for r in records(out)] == [r["keys"] for r in records(reference)]
    report = stager_reports(staged)[0]
    assert report["bytes_copied"] + sum(r["cache"]["fetch_bytes"] for r in records(out)) == shard_bytes(staged)
