"""Real multi-process runs: torchrun --nproc_per_node=4 (gloo) over a packed dataset."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from helpers.torchrun import torchrun as run_job
from test_loader_data import write_dataset

NPROC = 4


def torchrun(data: str, out: str, *extra: str, timeout: int = 150) -> subprocess.CompletedProcess:
    os.makedirs(out, exist_ok=True)
    return run_job("ddp_worker.py", NPROC, "--data", data, "--out", out, *extra, timeout=timeout)


def records(out: str) -> list[dict]:
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(NPROC)]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset(str(tmp_path_factory.mktemp("ddp") / "d"), [40, 35, 50, 30])


@pytest.fixture(scope="module")
def full_run(dataset, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("full"))
    res = torchrun(dataset[0], out, "--num-workers", "1")
    assert res.returncode == 0, res.stderr[-3000:]
    return records(out)


@pytest.mark.timeout(200)
def test_ranks_see_every_sample_once_with_equal_counts(dataset, full_run):
    _, keys = dataset
    for epoch in ("0", "1"):
        lens = {rec["epochs"][epoch]["len"] for rec in full_run}
        counts = {len(rec["epochs"][epoch]["batches"]) for rec in full_run}
        assert len(lens) == 1 and counts == lens
        seen = [k for rec in full_run for b in rec["epochs"][epoch]["batches"] for k in b]
        remainder = [keys[i] for i in full_run[0]["epochs"][epoch]["remainder"]]
        assert len(seen) == len(set(seen))
        assert sorted(seen + remainder) == sorted(keys)


@pytest.mark.timeout(400)
def test_kill_at_step_k_then_resume_matches_the_uninterrupted_run(dataset, full_run, tmp_path):
    k = 5
    first = torchrun(dataset[0], str(tmp_path / "a"), "--stop-at", str(k))
    assert first.returncode == 0, first.stderr[-3000:]
    states = [json.load(open(tmp_path / "a" / f"state-rank{r}.json")) for r in range(NPROC)]
    assert all(s == states[0] for s in states), "state_dict is identical on every rank"
    second = torchrun(
        dataset[0], str(tmp_path / "b"), "--resume", str(tmp_path / "a" / "state-rank0.json"), "--num-workers", "2"
    )
    assert second.returncode == 0, second.stderr[-3000:]
    a, b = records(str(tmp_path / "a")), records(str(tmp_path / "b"))
    for r in range(NPROC):
        expected = full_run[r]["epochs"]["0"]["batches"] + full_run[r]["epochs"]["1"]["batches"]
        got = a[r]["epochs"]["0"]["batches"] + b[r]["epochs"]["0"]["batches"] + b[r]["epochs"]["1"]["batches"]
        assert got == expected


@pytest.mark.timeout(500)
def test_a_compute_balanced_run_killed_and_resumed_matches_the_uninterrupted_one(dataset, full_run, tmp_path):
    """Issue 33: with a cost model each rank serves its plan's balanced batches (others than the
    plain run's), and a run killed at step 5 and resumed with other workers continues exactly."""
    balanced = ("--cost-model", "a=1,b=0.05")
    whole = torchrun(dataset[0], str(tmp_path / "whole"), *balanced)
    assert whole.returncode == 0, whole.stderr[-3000:]
    first = torchrun(dataset[0], str(tmp_path / "a"), *balanced, "--stop-at", "5", "--num-workers", "1")
    assert first.returncode == 0, first.stderr[-3000:]
    state = str(tmp_path / "a" / "state-rank0.json")
    second = torchrun(dataset[0], str(tmp_path / "b"), *balanced, "--resume", state, "--num-workers", "2")
    assert second.returncode == 0, second.stderr[-3000:]
    w, a, b = (records(str(tmp_path / d)) for d in ("whole", "a", "b"))
    for r in range(NPROC):
        expected = w[r]["epochs"]["0"]["batches"] + w[r]["epochs"]["1"]["batches"]
        got = a[r]["epochs"]["0"]["batches"] + b[r]["epochs"]["0"]["batches"] + b[r]["epochs"]["1"]["batches"]
        assert got == expected
    assert [rec["epochs"]["0"]["batches"] for rec in w] != [rec["epochs"]["0"]["batches"] for rec in full_run]
    for epoch in ("0", "1"):  # the same samples as the plain run's epoch, dealt otherwise
        served = sorted(k for rec in w for batch in rec["epochs"][epoch]["batches"] for k in batch)
        assert served == sorted(k for rec in full_run for batch in rec["epochs"][epoch]["batches"] for k in batch)


@pytest.mark.timeout(200)
def test_a_failing_sample_stops_the_job_with_its_name(dataset, tmp_path):
    bad = dataset[1][60]
    res = torchrun(dataset[0], str(tmp_path / "f"), "--num-workers", "2", "--fail-key", bad)
    assert res.returncode != 0
    assert f"injected failure on {bad}" in res.stderr + res.stdout
