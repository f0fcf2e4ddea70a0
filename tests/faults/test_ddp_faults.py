"""Fault suite, DDP: awkward layouts on real gloo process groups, and a rank whose worker fails.

Every rank is a real process started here (tests/faults/ddp_fault_worker.py) with a short
collective timeout, so a rank short of batches or a survivor of a failed rank shows up as a
bounded failure, never as a 30-minute hang. One process group per world size runs every
dataset/layout case in sequence, to keep torch start-ups few.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from test_loader_data import write_dataset

FAULTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(FAULTS))
WORKER = os.path.join(FAULTS, "ddp_fault_worker.py")


def run_jobs(jobs: list[dict], timeout: float) -> list[list]:
    """Run gloo jobs through ddp_fault_worker.py (one torch import; ranks forked); [rc, seconds] per rank per job."""
    path = os.path.join(jobs[0]["out"], os.pardir, "jobs.json")
    for job in jobs:
        os.makedirs(job["out"], exist_ok=True)
    with open(path, "w") as f:
        json.dump(jobs, f)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.pop("LOCAL_WORLD_SIZE", None)
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, WORKER, path], env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [json.loads(line) for line in res.stdout.splitlines()]
    assert [line["out"] for line in lines] == [job["out"] for job in jobs], res.stdout
    return [line["ranks"] for line in lines]


def logs(out: str, world: int) -> str:
    return "\n".join(f"--- rank {r}\n" + open(os.path.join(out, f"rank{r}.log")).read()[-2500:] for r in range(world))


# --------------------------------------------------------------------------- awkward layouts
def _skewed_lengths(n: int) -> np.ndarray:
    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 4, size=n)
    lengths[rng.choice(n, size=n // 10, replace=False)] = rng.integers(300, 500, size=n // 10)
    return lengths


@pytest.fixture(scope="module")
def layout_datasets(tmp_path_factory):
    base = tmp_path_factory.mktemp("ddp-layouts")
    skew_sizes = [37, 0, 4, 29, 1]
    return {
        # 5 shards of uneven sizes: divisible by no ranks x workers product used here
        "uneven": (write_dataset(str(base / "uneven"), [7, 13, 5, 11, 2], seed=1), {"batch_size": 3}),
        # 2 shards for up to 5 ranks / 5 nodes: boundary shards split between nodes
        "two_shards": (write_dataset(str(base / "two"), [23, 19], seed=2), {"batch_size": 2}),
        # mostly 1-3 tokens with 10% of 300-500: a token budget makes batch sizes vary 2x-200x
        "skewed": (
            write_dataset(
                str(base / "skewed"), skew_sizes, seed=3, extra=False, lengths=_skewed_lengths(sum(skew_sizes))
            ),
            {"max_tokens": 1000},
        ),
        # 3 samples in one shard: some layouts cannot give every rank a batch
        "tiny": (write_dataset(str(base / "tiny"), [3], seed=4), {"batch_size": 2}),
    }


def _cases(datasets: dict, world: int) -> list[dict]:
    cases = []
    for name, ((root, _), batching) in datasets.items():
        for rpn in sorted({world, 1} | ({2} if world % 2 == 0 else set())):
            for nw in (0, 2) if name == "uneven" else (1,):
                cases.append(
                    {
                        "name": f"{name}/rpn{rpn}/nw{nw}",
                        "dataset": name,
                        "data": root,
                        "ranks_per_node": rpn,
                        "num_workers": nw,
                        **batching,
                    }
                )
    return cases


WORLDS = (2, 3, 4, 5)


@pytest.fixture(scope="module")
def layout_runs(layout_datasets, tmp_path_factory):
    """Every world size's job, each running all its cases on one process group."""
    base = tmp_path_factory.mktemp("ddp-layout-runs")
    jobs, cases = [], {}
    for world in WORLDS:
        cases[world] = _cases(layout_datasets, world)
        path = base / f"cases-{world}.json"
        path.write_text(json.dumps(cases[world]))
        jobs.append(
            {
                "world": world,
                "out": str(base / f"w{world}"),
                "limit": 90,
                "argv": ["--cases", str(path), "--pg-timeout", "20"],
            }
        )
    ranks = run_jobs(jobs, timeout=400)
    return {w: (cases[w], job["out"], r) for w, job, r in zip(WORLDS, jobs, ranks)}


@pytest.mark.timeout(450)
@pytest.mark.parametrize("world", WORLDS)
def test_awkward_layouts_give_every_rank_equal_batches_or_a_clear_error(layout_datasets, layout_runs, world):
    cases, out, results = layout_runs[world]
    assert all(rc == 0 for rc, _ in results), f"ranks exited {results}:\n{logs(out, world)}"
    recs = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]
    refused = []
    for i, case in enumerate(cases):
        per_rank = [rec["cases"][i] for rec in recs]
        keys = layout_datasets[case["dataset"]][0][1]
        where = f"world {world}, case {case['name']}"
        errors = {res.get("error") for res in per_rank}
        assert len(errors) == 1, f"{where}: ranks disagree on refusing the layout: {per_rank}"
        if errors != {None}:
            msg = errors.pop()
            assert "too small" in msg and str(world) in msg, f"{where}: unclear refusal {msg!r}"
            refused.append(case["name"])
            continue
        n = per_rank[0]["len"]
        for r, res in enumerate(per_rank):
            assert res["len"] == n and len(res["batches"]) == n, f"{where}: rank {r} got {len(res['batches'])} of {n}"
            assert res["count_range"] == [n, n], f"{where}: batch counts across ranks {res['count_range']}"
        seen = [k for res in per_rank for b in res["batches"] for k in b]
        remainder = [keys[g] for g in per_rank[0]["remainder"]]
        assert len(seen) == len(set(seen)), f"{where}: a sample served twice"
        assert sorted(seen + remainder) == sorted(keys), f"{where}: samples lost or invented"
    # The tiny dataset fits one node of 2 or 3 ranks, never 4 or 5 ranks (3 samples).
    tiny = [c["name"] for c in cases if c["dataset"] == "tiny"]
    assert (world >= 4) == (set(tiny) <= set(refused)), (world, refused)
    assert all(name.startswith("tiny/") for name in refused), refused


# --------------------------------------------------------------------------- a sabotaged rank
@pytest.fixture(scope="module")
def sabotage_dataset(tmp_path_factory):
    return write_dataset(str(tmp_path_factory.mktemp("ddp-sabotage") / "d"), [30, 30, 30], seed=5)


WORLD = 3
PG_TIMEOUT = 10
LOADER_TIMEOUT = 3


KINDS = ("raise", "hang", "kill")


@pytest.fixture(scope="module")
def sabotage_runs(sabotage_dataset, tmp_path_factory):
    """One job per kind of sabotage on rank 1, run one after another: {kind: (bad key, out, [rc, s] per rank)}."""
    from shardtool.loader import ShardedLoader

    root, keys = sabotage_dataset
    # A key that rank 1 reads in its 3rd batch, so the job is past its first steps.
    ld = ShardedLoader(root, batch_size=4, seed=1, rank=1, world_size=WORLD, num_workers=0)
    bad = keys[int(ld.plan.batches()[2][0])]
    base = tmp_path_factory.mktemp("ddp-sabotage-runs")
    jobs = [
        {
            "world": WORLD,
            "out": str(base / kind),
            "limit": PG_TIMEOUT + 30,
            "argv": [
                "--data",
                root,
                "--batch-size",
                "4",
                "--num-workers",
                "2",
                "--loader-timeout",
                str(LOADER_TIMEOUT),
                "--pg-timeout",
                str(PG_TIMEOUT),
                "--sabotage",
                f"{kind}:{bad}",
                "--sabotage-rank",
                "1",
            ],
        }
        for kind in KINDS
    ]
    ranks = run_jobs(jobs, timeout=len(KINDS) * (PG_TIMEOUT + 30) + 60)
    return {kind: (bad, job["out"], r) for kind, job, r in zip(KINDS, jobs, ranks)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", KINDS)
def test_a_sabotaged_worker_fails_its_rank_fast_and_every_rank_exits(sabotage_runs, kind):
    bad, out, results = sabotage_runs[kind]
    text = logs(out, WORLD)
    assert all(rc is not None for rc, _ in results), f"{kind}: ranks still running after the bound: {results}\n{text}"
    assert all(rc != 0 for rc, _ in results), f"{kind}: every rank must fail: {results}\n{text}"
    recs = {
        r: json.load(open(os.path.join(out, f"rank{r}.json")))
        for r in range(WORLD)
        if os.path.exists(os.path.join(out, f"rank{r}.json"))
    }
    mine = recs[1]
    # raise, hang and kill all surface at the culprit's batch
    assert mine["steps"] == 2, mine
    # the sabotaged rank: within the loader's timeout (hang) or a few seconds (raise, kill), counted
    # from its first batch request (worker start-up included). A hung worker costs up to 5 s more:
    # the DataLoader waits that long for it to exit before terminating it.
    bound = LOADER_TIMEOUT + 10 if kind == "hang" else 8
    assert mine["elapsed"] < bound, f"{kind}: rank 1 failed after {mine['elapsed']:.1f}s"
    err = mine["error"]
    assert "rank 1/3" in err and "epoch 0" in err, err
    if kind == "raise":
        assert f"injected failure on {bad}" in err and "shard-0000" in err, err
    elif kind == "hang":
        assert mine["type"] == "LoaderError" and "batch 2" in err and "shard-0000" in err and "timed out" in err, err
    else:
        assert mine["type"] == "LoaderError" and "batch 2" in err and "shard-0000" in err, err
        assert "killed" in err or "exited" in err, err
    # the others: their all-reduce fails once rank 1 is gone, long before 30 minutes
    first_exit = results[1][1]
    for r in (0, 2):
        assert recs[r]["type"] == "RuntimeError", recs[r]
        assert results[r][1] < first_exit + PG_TIMEOUT + 5, f"{kind}: rank {r} took {results[r][1]:.1f}s\n{text}"
