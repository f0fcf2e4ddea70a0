"""A shared cluster on the real (local) SLURM test cluster: one prolog (examples/slurm/prolog.sh) for
every job, each job naming its data and layout in its comment, two nodes sharing their caches.

- Jobs with three datasets and two layouts share both nodes; each reads its whole epoch from its own
  staged shards (nothing fetched on a miss). A budget forces the third job's prolog to evict: it takes
  the version of the job that finished, never that of the job still running (which then reads its
  epoch again, still without a fetch).
- The dataset moved away after a warm: the next job's prolog finds the node caches complete (exit 0,
  a warning) and the job reads from them.
- A job with a mistyped dataset: no node drains; the job fails with the prolog's finding in its output.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from helpers.cachedata import make_dataset  # noqa: E402

NODES = ["node1", "node2"]
READER = REPO / "tests" / "slurm" / "stage_reader.py"


def _prolog(work: Path, cache_root: Path, max_bytes: int) -> Path:
    conf = work / "warm.conf"
    conf.write_text(
        f"SHARDTOOL_PYTHON={sys.executable}\nCACHE_ROOT={cache_root}\nJOBS=4\nMAX_BYTES={max_bytes}\nTIMEOUT=60\n"
        f"SCONTROL={shutil.which('scontrol') or '/usr/bin/scontrol'}\n"
        f"SQUEUE={shutil.which('squeue') or '/usr/bin/squeue'}\nexport PYTHONPATH={REPO}\n"
    )
    prolog = work / "prolog.sh"
    # The prolog gets no job environment: the wrapper is how a site points it at its config.
    prolog.write_text(
        f"#!/bin/bash\nexport SHARDTOOL_WARM_CONF={conf}\nexec /bin/bash {REPO}/examples/slurm/prolog.sh\n"
    )
    prolog.chmod(0o755)
    return prolog


def _job(work: Path) -> Path:
    job = work / "job.sh"
    job.write_text(
        "#!/bin/bash\nset -eu\n"
        'srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 '
        f'{sys.executable} {READER} "$@"\n'
    )
    job.chmod(0o755)
    return job


def _env(c, cache_root: Path) -> dict:
    return {**c.env, "CACHE_ROOT": str(cache_root), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _node_share(url: str, node: int, mesh: str | None = None) -> int:
    from shardtool.cache import assigned_shards
    from shardtool.format import open_dataset
    from shardtool.plan import DataLayout, Layout, Placement, data_parallel, parse_mesh

    ds = open_dataset(url)
    placement = Placement(Layout(2, 2), node)
    data = (
        data_parallel(Placement(Layout(2, 2), 0, 0), mesh=parse_mesh(mesh), dp_dims=("dp",))[0]
        if mesh
        else DataLayout.pure_dp(Layout(2, 2))
    )
    return sum(ds.manifest.shards[i].bytes for i in assigned_shards(ds.summaries, placement, data))


def _cached(cache_dir: Path, url: str, version: str | None = None) -> set[int]:
    from shardtool.cache import VersionDir
    from shardtool.format import open_dataset

    ds = open_dataset(url)
    vd = VersionDir(str(cache_dir), version or ds.version)
    return {i for i, info in enumerate(ds.manifest.shards) if vd.trusted(i, info)}


def _results(out: Path, tag: str = "pass1") -> dict:
    return {n: json.loads((out / f"{n}.{tag}.json").read_text()) for n in NODES if (out / f"{n}.{tag}.json").exists()}


def _explain(c, r) -> str:
    return f"job {r.jobid} {r.state} exit {r.exit_code}\n{r.read_output()[-3000:]}\n{c.logs_tail()}"


@pytest.mark.timeout(420)
def test_shared_cluster_jobs_stage_their_own_data(slurm_cluster_with_prolog, tmp_path):
    from shardtool.format import open_dataset

    work = tmp_path
    ds = [make_dataset(str(work / f"ds{i}"), shards=8, samples=4, sample_bytes=16_000, seed=i) for i in range(3)]
    cache_root = work / "cache"
    cache_root.mkdir()
    a_share = [_node_share(ds[0], n) for n in range(2)]
    c_share = [_node_share(ds[2], n) for n in range(2)]
    b_full = sum(s.bytes for s in open_dataset(ds[1]).manifest.shards)
    assert _node_share(ds[1], 0, "pp=2,dp=2") == b_full  # each node hosts one pipeline stage of both DP ranks
    # A then B fit; C fits only after half of A's node share goes
    budget = b_full + max(c_share) + min(a_share) // 2
    assert all(a + b_full <= budget < a + b_full + c for a, c in zip(a_share, c_share))
    c = slurm_cluster_with_prolog(_prolog(work, cache_root, budget))
    job = _job(work)
    env = _env(c, cache_root)
    outs = {k: work / f"out-{k}" for k in "abcde"}
    for o in outs.values():
        o.mkdir()

    # --- job A: dataset 0, pure data parallelism, 2 nodes x 2 ranks; it finishes
    a = c.sbatch(job, "-N2", f"--comment=shardtool:{ds[0]}", script_args=[ds[0], str(outs["a"])], env=env, timeout=120)
    assert a.ok, _explain(c, a)
    ra = _results(outs["a"])
    assert sorted(ra) == NODES and all(r["fetched_bytes"] == 0 and r["batches"] > 0 for r in ra.values()), ra

    # --- job B: dataset 1, mesh pp=2,dp=2 (every node stages every shard); still running while C starts
    b_comment = json.dumps({"url": ds[1], "mesh": "pp=2,dp=2", "ranks_per_node": 2})
    flag = work / "b-may-finish"
    b = c.sbatch(
        job,
        "-N2",
        f"--comment=shardtool:{b_comment}",
        env=env,
        wait=False,
        script_args=[ds[1], str(outs["b"]), "--mesh", "pp=2,dp=2", "--wait", str(flag)],
    )
    deadline = time.monotonic() + 120
    while len(_results(outs["b"])) < 2:
        state = c.job_state(b.jobid)
        assert state in ("PENDING", "CONFIGURING", "RUNNING"), _explain(c, c.job_result(b.jobid))
        assert time.monotonic() < deadline, _explain(c, c.job_result(b.jobid))
        time.sleep(0.3)
    rb = _results(outs["b"])
    assert all(r["fetched_bytes"] == 0 for r in rb.values()), rb

    # --- job C: dataset 2 under the budget: evicts from A's version (A finished), never B's (B runs)
    cj = c.sbatch(job, "-N2", f"--comment=shardtool:{ds[2]}", script_args=[ds[2], str(outs["c"])], env=env, timeout=120)
    assert cj.ok, _explain(c, cj)
    assert all(r["fetched_bytes"] == 0 for r in _results(outs["c"]).values()), _results(outs["c"])
    for n, node in enumerate(NODES):
        report = json.loads((cache_root / f"{node}.warm-{cj.jobid}.json").read_text())
        assert report["status"] == "ok" and report["evicted_shards"] >= 1, report
        assert _cached(cache_root / node, ds[1]) == set(range(8)), node  # B's version: untouched
        assert len(_cached(cache_root / node, ds[0])) < 4, node  # A's node share: partly evicted
        # squeue no longer lists A: C's prolog dropped its record; B's stays while B runs
        jobs = cache_root / node / "jobs"
        assert not (jobs / f"{a.jobid}.json").exists() and (jobs / f"{b.jobid}.json").exists()
    assert c.job_state(b.jobid) == "RUNNING"
    flag.touch()
    assert c.wait_state(b.jobid, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=120) == "COMPLETED", _explain(
        c, c.job_result(b.jobid)
    )
    rb2 = _results(outs["b"], "pass2")
    assert rb2 == rb, (rb, rb2)  # the same epoch again, still from its staged shards

    # --- job D: dataset 1 moved away after its warm; pure DP now: the node caches hold it all
    shutil.move(ds[1], ds[1] + ".moved")
    d = c.sbatch(job, "-N2", f"--comment=shardtool:{ds[1]}", script_args=[ds[1], str(outs["d"])], env=env, timeout=120)
    assert d.ok, _explain(c, d)
    rd = _results(outs["d"])
    assert sorted(rd) == NODES and all(r["fetched_bytes"] == 0 for r in rd.values()), rd
    assert sum(r["samples"] for r in rd.values()) == sum(r["samples"] for r in rb.values()) // 2
    assert "has no manifest any more" in d.read_output()  # the prolog's warning reaches the job
    for node in NODES:
        assert json.loads((cache_root / f"{node}.warm-{d.jobid}.json").read_text())["status"] == "cached"

    # --- job E: a mistyped dataset: no node drains, the job fails with the prolog's finding
    typo = ds[0] + "-final"
    e = c.sbatch(
        job,
        "-N2",
        "--no-requeue",
        f"--comment=shardtool:{typo}",
        script_args=[typo, str(outs["e"])],
        env=env,
        timeout=120,
    )
    assert e.state == "FAILED", _explain(c, e)
    out = e.read_output()
    assert "StagingError: the SLURM prolog could not stage this job's data: no dataset at" in out, out[-3000:]
    for node in NODES:  # idle again once the job's end is through; never drained
        assert c.wait_node_state(node, {"idle"}, timeout=30) == "idle"
        assert "Prolog" not in c.node_info(node).get("Reason", "")
