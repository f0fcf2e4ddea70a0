"""Mixtures in real processes: warmed caches on two simulated nodes serve torchrun ranks with the
sources gone; the example trains, is killed, and resumes under new weights."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from helpers.runcli import REPO, shardtool_cli
from helpers.torchrun import torchrun as run_job
from shardtool.loader import Mixture, ShardedLoader
from test_loader_data import write_dataset

SHARDS = {"web": [90, 60, 80, 70, 50, 40], "code": [40, 30, 50, 35], "math": [30, 20, 25, 25]}
WEIGHTS = {"web": 0.5, "code": 0.3, "math": 0.2}


def torchrun(script: str, *args: str, nproc: int, timeout: int) -> subprocess.CompletedProcess:
    return run_job(script, nproc, *args, timeout=timeout, env={"GLOO_SOCKET_IFNAME": "lo"})


@pytest.fixture
def mix(tmp_path):
    keys = {}
    for i, (name, shards) in enumerate(SHARDS.items()):
        _, keys[name] = write_dataset(str(tmp_path / "data" / name), shards, seed=i, prefix=name[0])
    path = tmp_path / "data" / "mix.json"
    path.write_text(json.dumps({"sources": {n: {"url": n, "weight": w} for n, w in WEIGHTS.items()}}))
    return str(path), keys


@pytest.mark.timeout(300)
def test_a_warmed_three_source_mixture_on_two_nodes_serves_every_rank_with_the_sources_gone(mix, tmp_path):
    path, _ = mix
    for node in range(2):
        os.makedirs(tmp_path / f"node{node}")
        res = shardtool_cli(
            "warm",
            path,
            "--cache-dir",
            str(tmp_path / f"node{node}" / "cache"),
            "--nodes",
            "2",
            "--node-rank",
            str(node),
            "--ranks-per-node",
            "2",
            "-q",
            timeout=120,
        )
        assert res.returncode == 0, res.stderr
        assert all(f"source '{n}': warm ok" in res.stderr for n in WEIGHTS)
    steps = 60
    expected = []
    for r in range(4):  # what each rank reads straight from the sources
        ld = ShardedLoader(
            Mixture.from_file(path),
            steps=steps,
            max_tokens=160,
            seed=2,
            rank=r,
            world_size=4,
            ranks_per_node=2,
            num_workers=0,
        )
        expected.append([[b["__source__"], list(b["__key__"])] for b in ld])
    shutil.move(str(tmp_path / "data"), str(tmp_path / "moved-away"))  # the parallel filesystem is gone
    os.makedirs(tmp_path / "data")
    shutil.copy(str(tmp_path / "moved-away" / "mix.json"), path)  # only the mixture file is left
    out = tmp_path / "out"
    out.mkdir()
    res = torchrun(
        os.path.join(REPO, "tests", "helpers", "mixture_worker.py"),
        "--mixture",
        path,
        "--out",
        str(out),
        "--steps",
        str(steps),
        "--ranks-per-node",
        "2",
        "--cache-base",
        str(tmp_path),
        "--num-workers",
        "1",
        nproc=4,
        timeout=240,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    got = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    for r in range(4):
        assert got[r]["batches"] == expected[r]
        assert got[r]["report"]["step"] == steps
    assert {b[0] for rank in got for b in rank["batches"]} == set(WEIGHTS)


@pytest.mark.timeout(400)
def test_the_example_trains_a_mixture_and_resumes_under_new_weights(mix, tmp_path):
    path, keys = mix
    example = os.path.join(REPO, "examples", "train_ddp.py")
    common = [
        "--mixture",
        path,
        "--steps",
        "40",
        "--max-tokens",
        "160",
        "--num-workers",
        "1",
        "--ckpt-dir",
        str(tmp_path / "ckpt"),
        "--ckpt-every",
        "15",
        "--collective-timeout",
        "60",
    ]
    first = torchrun(example, *common, "--max-steps", "15", "--log-dir", str(tmp_path / "a"), nproc=2, timeout=200)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-4000:]
    second = torchrun(
        example,
        *common,
        "--weights",
        "web=0.2,code=0.2,math=0.6",
        "--log-dir",
        str(tmp_path / "b"),
        nproc=2,
        timeout=200,
    )
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-4000:]
    assert "resumed from step 15" in second.stdout
    for r in range(2):
        before = [json.loads(x) for x in (tmp_path / "a" / f"keys.rank{r}.jsonl").read_text().splitlines()]
        after = [json.loads(x) for x in (tmp_path / "b" / f"keys.rank{r}.jsonl").read_text().splitlines()]
        assert [x["step"] for x in before + after] == list(range(1, 41))
        summary = json.loads((tmp_path / "b" / f"summary.rank{r}.json").read_text())
        assert summary["steps"] == 40 and summary["mixture"]["phase_from_step"] == 15
        math_share = sum(x["source"] == "math" for x in after) / len(after)
        assert math_share > 0.35  # the new weights (0.6 of the tokens) took over at the resume
        # Every source continued from its cursor: the rank's batches of a source, before and
        # after, are the source's own plan in order (what an uninterrupted run of it serves).
        ld = ShardedLoader(
            Mixture.from_file(path),
            steps=40,
            max_tokens=160,
            seed=0,
            rank=r,
            world_size=2,
            ranks_per_node=2,
            num_workers=0,
        )
        for name in WEIGHTS:
            served = [x["keys"] for x in before + after if x["source"] == name]
            planner = ld.planner.planners[name]
            plan_keys, epoch = [], 0
            while len(plan_keys) < len(served):
                plan = planner.rank_plan(planner.start(epoch, ld.datasets[name].version, ld.data_layout), r)
                plan_keys += [[keys[name][g] for g in plan.batch(i)] for i in range(plan.batches_per_rank)]
                epoch += 1
            assert served == plan_keys[: len(served)], name


@pytest.mark.timeout(300)
def test_killed_and_resumed_ranks_serve_exactly_the_uninterrupted_batches(mix, tmp_path):
    path, _ = mix
    steps, cut = 50, 23
    expected = []
    for r in range(2):
        ld = ShardedLoader(
            Mixture.from_file(path),
            steps=steps,
            max_tokens=160,
            seed=2,
            rank=r,
            world_size=2,
            ranks_per_node=2,
            num_workers=0,
        )
        expected.append([[b["__source__"], list(b["__key__"])] for b in ld])
    worker = os.path.join(REPO, "tests", "helpers", "mixture_worker.py")
    common = ["--mixture", path, "--steps", str(steps), "--ranks-per-node", "2"]
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    first = torchrun(
        worker, *common, "--out", str(a), "--stop-at", str(cut), "--num-workers", "2", nproc=2, timeout=200
    )
    assert first.returncode == 0, first.stderr[-4000:]
    states = [json.loads((a / f"state-rank{r}.json").read_text()) for r in range(2)]
    assert states[0] == states[1] and states[0]["step"] == cut
    second = torchrun(
        worker,
        *common,
        "--out",
        str(b),
        "--resume",
        str(a / "state-rank0.json"),
        "--num-workers",
        "0",
        nproc=2,
        timeout=200,
    )
    assert second.returncode == 0, second.stderr[-4000:]
    for r in range(2):
        before = json.loads((a / f"rank{r}.json").read_text())["batches"]
        after = json.loads((b / f"rank{r}.json").read_text())["batches"]
        assert before + after == expected[r]


@pytest.mark.timeout(300)
def test_a_third_source_added_on_resume_joins_while_the_others_continue(mix, tmp_path):
    """Issue 36 item 2 under torchrun: a run of two sources is stopped after its checkpoint,
    the mixture file gains a third, and the resumed ranks continue the two where they were (no
    sample of theirs again in the pass) and start the third at its beginning, every rank the
    same steps, a warning line for the source added."""
    path, keys = mix
    two = tmp_path / "data" / "two.json"
    two.write_text(json.dumps({"sources": {n: {"url": n, "weight": WEIGHTS[n]} for n in ("web", "code")}}))
    steps, cut = 28, 12  # short of a pass of any source: within it, nothing may come twice
    worker = os.path.join(REPO, "tests", "helpers", "mixture_worker.py")
    common = ["--steps", str(steps), "--ranks-per-node", "2", "--num-workers", "1"]
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    first = torchrun(
        worker, "--mixture", str(two), *common, "--out", str(a), "--stop-at", str(cut), nproc=2, timeout=200
    )
    assert first.returncode == 0, first.stderr[-4000:]
    second = torchrun(
        worker,
        "--mixture",
        path,
        *common,
        "--out",
        str(b),
        "--resume",
        str(a / "state-rank0.json"),
        nproc=2,
        timeout=200,
    )
    assert second.returncode == 0, second.stderr[-4000:]
    assert "source 'math' added (from its beginning)" in second.stderr
    served = {"web": [], "code": [], "math": []}
    for r in range(2):
        before = json.loads((a / f"rank{r}.json").read_text())["batches"]
        after = json.loads((b / f"rank{r}.json").read_text())["batches"]
        assert len(before) == cut and len(after) == steps - cut  # every rank the same steps
        assert not any(src == "math" for src, _ in before) and any(src == "math" for src, _ in after)
        for src, ks in before + after:
            served[src] += ks
    for name, got in served.items():  # within one pass of each source nothing comes twice
        assert len(got) < len(keys[name]) and len(got) == len(set(got)) and set(got) <= set(keys[name])
