"""Data layouts on real gloo process groups: TP peers, PP stages across nodes, DP resizes.

Every rank is a real process (tests/helpers/mesh_worker.py) with a device mesh built by torch's own
``init_device_mesh`` and a bounded collective timeout, so a rank short of batches fails the job
instead of hanging it.
  - TP=2 x DP=2 on 4 ranks: the two TP peers of each DP rank yield byte-identical batches.
  - PP=2 x DP=2 on 2 nodes x 2 ranks (torchrun --nnodes 2 on localhost): each DP rank's two
    stages live on different nodes, so each node's cache, warmed with `shardtool warm --mesh`,
    must hold both DP ranks' range; the epoch runs with the source renamed away.
  - DP 4 -> 2 -> 3: checkpoint mid-epoch, restart on another world size, twice.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from helpers.cachedata import child_env
from helpers.forkranks import free_port
from helpers.runcli import shardtool_cli
from test_loader_data import write_dataset

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(TESTS)
WORKER = os.path.join(TESTS, "helpers", "mesh_worker.py")
BATCH = 4


def worker_env() -> dict:
    env = {k: v for k, v in child_env().items() if not k.startswith(("TORCHELASTIC_", "GROUP_", "ROLE_"))}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    return env


def forked(jobs: list[dict], base, timeout: float) -> list[list]:
    """Run the jobs one after another (ranks forked from one torch import); [rc, seconds] per rank per job."""
    path = os.path.join(base, "jobs.json")
    with open(path, "w") as f:
        json.dump(jobs, f)
    res = subprocess.run(
        [sys.executable, WORKER, path], env=worker_env(), capture_output=True, text=True, timeout=timeout
    )
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [json.loads(line) for line in res.stdout.splitlines()]
    assert [line["out"] for line in lines] == [job["out"] for job in jobs], res.stdout
    for job, line in zip(jobs, lines):
        assert all(rc == 0 for rc, _ in line["ranks"]), f"{job['out']}: ranks exited {line['ranks']}\n{logs(job)}"
    return [line["ranks"] for line in lines]


def logs(job: dict) -> str:
    out = []
    for r in range(job["world"]):
        path = os.path.join(job["out"], f"rank{r}.log")
        if os.path.exists(path):
            out.append(f"--- rank {r}\n" + open(path).read()[-2500:])
    return "\n".join(out)


def records(out, world: int) -> list[dict]:
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]


def served(recs: list[dict]) -> list[str]:
    return [k for rec in recs for b in rec["keys"] for k in b]


def assert_replicas_identical_and_dp_ranks_disjoint(recs: list[dict], dp_of_rank: list[int]) -> None:
    assert [rec["dp_rank"] for rec in recs] == dp_of_rank, "the DP rank comes from the mesh, not the global rank"
    counts = {len(rec["keys"]) for rec in recs}
    assert len(counts) == 1 and counts == {recs[0]["len"]}, f"batch counts {counts}, len {recs[0]['len']}"
    assert all(rec["count_range"] == [recs[0]["len"]] * 2 for rec in recs)
    assert all(rec["states"] == recs[0]["states"] for rec in recs), "state_dict() is identical on every rank"
    by_dp: dict[int, list[dict]] = {}
    for rec in recs:
        by_dp.setdefault(rec["dp_rank"], []).append(rec)
    for dp, peers in by_dp.items():
        assert len(peers) > 1
        for peer in peers[1:]:
            assert peer["digests"] == peers[0]["digests"], f"DP rank {dp}: peers' batches differ in some byte"
            assert peer["keys"] == peers[0]["keys"]
    per_dp = [served(peers[:1]) for peers in by_dp.values()]
    everything = [k for keys in per_dp for k in keys]
    assert len(everything) == len(set(everything)), "DP ranks read disjoint samples"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset(str(tmp_path_factory.mktemp("mesh") / "d"), [37, 41, 30, 45, 28, 39], seed=11)


@pytest.mark.timeout(240)
def test_tp2_dp2_peers_yield_identical_batches_from_a_device_mesh(dataset, tmp_path):
    root, keys = dataset
    job = {
        "world": 4,
        "out": str(tmp_path / "tp"),
        "limit": 150,
        "argv": ["--data", root, "--mesh", "dp=2,tp=2", "--dp-dim", "dp", "--batch-size", str(BATCH)],
    }
    forked([job], tmp_path, timeout=200)
    recs = records(job["out"], 4)
    # mesh (dp, tp), row-major: ranks 0, 1 are DP rank 0; ranks 2, 3 DP rank 1
    assert_replicas_identical_and_dp_ranks_disjoint(recs, [0, 0, 1, 1])
    assert all(rec["dp_size"] == 2 for rec in recs)
    got = served([recs[0], recs[2]])
    remainder = [keys[i] for i in set(recs[0]["remainder"]) | set(recs[2]["remainder"])]
    assert sorted(got + remainder) == sorted(keys), "the two DP ranks serve the epoch, less its remainder"


def _torchrun(node: int, port: int, out: str, argv: list[str]) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--node_rank",
        str(node),
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(port),
        WORKER,
        "--out",
        out,
        *argv,
    ]
    log = open(os.path.join(out, f"torchrun-node{node}.log"), "w")
    return subprocess.Popen(cmd, env=worker_env(), stdout=log, stderr=subprocess.STDOUT)


@pytest.mark.timeout(300)
def test_pp2_dp2_across_two_nodes_runs_from_mesh_warmed_caches_alone(dataset, tmp_path):
    root, keys = dataset
    moved = str(tmp_path / "source")
    shutil.copytree(root, moved)  # the module's dataset stays in place for the other tests
    caches = [str(tmp_path / f"node{k}" / "cache") for k in range(2)]
    for k in range(2):
        os.makedirs(tmp_path / f"node{k}")  # each simulated node's local disk
    reports = []
    for k in range(2):
        res = shardtool_cli(
            "warm",
            moved,
            "--cache-dir",
            caches[k],
            "--mesh",
            "pp=2,dp=2",
            "--nodes",
            "2",
            "--node-rank",
            str(k),
            "--ranks-per-node",
            "2",
            "--json",
            "-q",
            timeout=120,
        )
        assert res.returncode == 0, res.stderr
        reports.append(json.loads(res.stdout))
        assert "mesh pp=2,dp=2" in res.stderr and "this node reads data group 0 (DP ranks 0-1)" in res.stderr
    # Each DP rank has a stage on each node: both nodes hold the whole range, where pure data
    # parallelism would give each node half (and the run below would miss shards offline).
    shards = len(json.load(open(os.path.join(moved, "index.json")))["shards"])
    assert [r["assigned"] for r in reports] == [shards, shards]
    assert all(r["data_layout"]["mesh"] == "pp=2,dp=2" and r["data_layout"]["node_dp_ranks"] == [0, 1] for r in reports)
    pure = shardtool_cli(
        "warm",
        moved,
        "--cache-dir",
        str(tmp_path / "pure"),
        "--nodes",
        "2",
        "--node-rank",
        "0",
        "--ranks-per-node",
        "2",
        "--json",
        "-q",
        timeout=120,
    )
    assert json.loads(pure.stdout)["assigned"] < shards
    os.rename(moved, moved + ".away")  # the shared filesystem is gone: the caches must serve everything

    out = str(tmp_path / "pp")
    os.makedirs(out)
    port = free_port()
    argv = [
        "--data",
        moved,
        "--cache-dir",
        str(tmp_path / "node{node}" / "cache"),
        "--mesh",
        "pp=2,dp=2",
        "--dp-dim",
        "dp",
        "--batch-size",
        str(BATCH),
        "--pg-timeout",
        "60",
    ]
    procs = [_torchrun(k, port, out, argv) for k in range(2)]
    try:
        rcs = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    text = "\n".join(open(os.path.join(out, f"torchrun-node{k}.log")).read()[-3000:] for k in range(2))
    assert rcs == [0, 0], text
    recs = records(out, 4)
    # mesh (pp, dp), row-major: ranks 0, 2 are DP rank 0 (stages on nodes 0 and 1); 1, 3 DP rank 1
    assert_replicas_identical_and_dp_ranks_disjoint(recs, [0, 1, 0, 1])
    got = served([recs[0], recs[1]])
    remainder = [keys[i] for i in set(recs[0]["remainder"]) | set(recs[1]["remainder"])]
    assert sorted(got + remainder) == sorted(keys)


@pytest.mark.timeout(300)
def test_dp_4_to_2_to_3_resume_chain_serves_every_sample_once(dataset, tmp_path):
    from shardtool.format import open_dataset
    from shardtool.plan import Batching, DataLayout, Layout, Planner
    from shardtool.plan.state import LoaderState

    root, keys = dataset
    common = ["--data", root, "--batch-size", str(BATCH)]
    # 4 ranks as 2 nodes x 2, then 2 and 3 nodes of one rank: the data groups change too.
    runs = [(4, 2, ["--stop-at", "5"]), (2, 1, ["--stop-at", "6"]), (3, 1, [])]
    jobs = []
    for i, (world, local, extra) in enumerate(runs):
        resume = ["--resume", os.path.join(jobs[-1]["out"], "state-rank0.json")] if jobs else []
        jobs.append(
            {
                "world": world,
                "out": str(tmp_path / f"run{i}"),
                "limit": 120,
                "env": {"LOCAL_WORLD_SIZE": str(local)},
                "argv": [*common, *extra, *resume],
            }
        )
    forked(jobs, tmp_path, timeout=280)
    recs = [records(job["out"], world) for job, (world, _, _) in zip(jobs, runs)]
    for i, run in enumerate(recs):
        counts = {len(rec["keys"]) for rec in run}
        assert len(counts) == 1, f"run {i}: every rank the same batch count, found {counts}"
        assert all(rec["epoch"] == 0 for rec in run)
        if i:
            states = [
                json.load(open(os.path.join(jobs[i - 1]["out"], f"state-rank{r}.json"))) for r in range(runs[i - 1][0])
            ]
            assert all(s == states[0] for s in states), f"run {i - 1}: the checkpointed state is every rank's"
    assert {len(rec["keys"]) for rec in recs[0]} == {5} and {len(rec["keys"]) for rec in recs[1]} == {6}
    assert recs[2][0]["len"] == len(recs[2][0]["keys"]) > 0, "the last run finishes the epoch"

    got = [k for run in recs for k in served(run)]
    assert len(got) == len(set(got)), "no sample served twice across the two resizes"
    # What the epoch leaves out: the first layout's remainder, and the batches each re-deal
    # could not divide over the new DP size (fewer than it, each time).
    final = json.load(open(os.path.join(jobs[1]["out"], "state-rank0.json")))
    batching = Batching(batch_size=BATCH, seed=3)
    planner = Planner(open_dataset(root), batching)
    resumed = planner.continue_on(LoaderState.from_dict(final, batching=batching), DataLayout.pure_dp(Layout(3, 1)))
    assert len(resumed.segments) == 3
    leftover = planner.left_over(resumed)
    # Each re-deal leaves (unserved batches) mod (new DP size): here 4 x (n0 - 5) over 2 ranks,
    # then 2 x (n1 - 6) over 3.
    n0, n1 = recs[0][0]["len"], recs[1][0]["len"]
    assert n1 == 4 * (n0 - 5) // 2 and recs[2][0]["len"] == 2 * (n1 - 6) // 3
    assert len(leftover) == 4 * (n0 - 5) % 2 + 2 * (n1 - 6) % 3
    remainder = {i for rec in recs[0] for i in rec["remainder"]}
    missing = [keys[i] for i in sorted(remainder)] + [keys[i] for b in leftover for i in b.tolist()]
    assert sorted(got + missing) == sorted(keys), "every sample served once, except the remainder and leftover"
