"""End to end on a real (local, 2-node) SLURM cluster, the way users run shardtool.

The prolog warms each node's shards into that node's cache; the job runs torchrun on every node
(2 ranks each, gloo) training a tiny LM through ShardedLoader(cache_dir=...); a short job asked
for as --ntasks-per-node=2 runs the same way; a further job is requeued mid-epoch after a
checkpoint and must continue with exactly the batches (and losses) of an uninterrupted run. A
rerun prolog copies nothing.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))
from report import dataset_keys, read_step_logs  # noqa: E402  the example's own log reader

NODES = ["node1", "node2"]
TRAIN_ARGS = "--max-tokens 2048 --epochs 1 --num-workers 1 --seq-len 32 --vocab 512"


def _write_prolog(work: Path, cache_root: Path) -> Path:
    conf = work / "warm.conf"
    conf.write_text(
        f"SHARDTOOL_PYTHON={sys.executable}\nCACHE_ROOT={cache_root}\n"
        f"SCONTROL={shutil.which('scontrol') or '/usr/bin/scontrol'}\nJOBS=4\nexport PYTHONPATH={REPO}\n"
    )
    prolog = work / "prolog.sh"
    # The prolog gets no job environment: the wrapper is how a site points it at its config.
    prolog.write_text(
        f"#!/bin/bash\nexport SHARDTOOL_WARM_CONF={conf}\nexec /bin/bash {REPO}/examples/slurm/prolog.sh\n"
    )
    prolog.chmod(0o755)
    return prolog


def _job_env(c, work: Path, dataset: str, cache_root: Path, name: str, extra: str = "") -> dict:
    env = dict(c.env)
    env.update(
        DATASET_URL=dataset,
        CACHE_ROOT=str(cache_root),
        CKPT_DIR=str(work / f"ckpt-{name}"),
        TRAIN_SCRIPT=str(REPO / "examples" / "train_ddp.py"),
        RANKS_PER_NODE="2",
        TRAIN_ARGS=f"{TRAIN_ARGS} --log-dir {work / f'log-{name}'} {extra}",
        SHARDTOOL_PYTHON=sys.executable,
        MASTER_ADDR="127.0.0.1",
        GLOO_SOCKET_IFNAME="lo",
        PYTHONPATH=str(REPO),
        OMP_NUM_THREADS="1",
    )
    return env


def _warm_report(cache_root: Path, node: str, jobid: int) -> dict:
    return json.loads((cache_root / f"{node}.warm-{jobid}.json").read_text())


def _explain(c, result) -> str:
    return f"job {result.jobid} {result.state} exit {result.exit_code}\n{result.read_output()}\n{c.logs_tail()}"


@pytest.mark.timeout(900)
def test_prolog_warm_ddp_training_and_requeue_resume(slurm_cluster_with_prolog, tmp_path):
    from shardtool import cache
    from shardtool.format import open_dataset
    from shardtool.loader import ShardedLoader
    from shardtool.pack.synthetic import write_synthetic
    from shardtool.plan import DataLayout, Layout, shards_for_node
    from shardtool.plan.synthetic import lognormal_lengths

    work = tmp_path
    dataset = write_synthetic(
        str(work / "dataset"),
        2400,
        samples_per_shard=170,
        vocab=512,
        lengths=lognormal_lengths(2400, median=100.0, sigma=0.6, high=1024),
    ).root
    cache_root = work / "nodes"
    cache_root.mkdir()
    c = slurm_cluster_with_prolog(_write_prolog(work, cache_root))
    stage = f"--comment=shardtool:{dataset}"  # the job says what its prolog stages
    sbatch = REPO / "examples" / "slurm" / "train.sbatch"

    # --- job A: prolog warms both nodes, then an uninterrupted epoch on 2 nodes x 2 ranks
    a = c.sbatch(sbatch, "-N2", stage, env=_job_env(c, work, dataset, cache_root, "a"), timeout=400)
    assert a.ok, _explain(c, a)
    ds = open_dataset(dataset)
    for i, node in enumerate(NODES):
        mine = shards_for_node(ds.summaries, DataLayout.pure_dp(Layout(len(NODES), 1)), i)
        report = _warm_report(cache_root, node, a.jobid)
        assert report["status"] == "ok" and report["shards_copied"] == len(mine), report
        # Every shard this node's ranks read came from its own cache: the cache holds exactly
        # the node's assignment, so no rank fetched anything else on a miss.
        dc = cache.open_cache(dataset, str(cache_root / node))
        assert {s for s in range(ds.num_shards) if dc.is_cached(s)} == set(mine)

    steps_a = read_step_logs(str(work / "log-a"))
    summaries = [json.loads((work / "log-a" / f"summary.rank{r}.json").read_text()) for r in range(4)]
    assert sorted(steps_a) == [0, 1, 2, 3]
    assert len({s["steps"] for s in summaries}) == 1 and summaries[0]["steps"] > 10
    seen = [k for r in steps_a.values() for e in r.values() for k in e["keys"]]
    probe = ShardedLoader(dataset, max_tokens=2048, seed=0, rank=0, world_size=4, ranks_per_node=2, num_workers=0)
    keys = dataset_keys(ds)
    all_keys = set(keys)
    remainder = {keys[g] for g in probe.remainder}
    assert len(seen) == len(set(seen)), "a sample was served twice in one epoch"
    assert set(seen) == all_keys - remainder

    # --- job C: the allocation asked for as tasks per node (sbatch -N2 --ntasks-per-node=2), as most
    # users ask for 2 GPUs' worth of tasks: still one torchrun agent per node (two would collide
    # on the rendezvous port), starting the node's 2 ranks; a short run
    env_c = _job_env(c, work, dataset, cache_root, "c", "--max-steps 3")
    del env_c["RANKS_PER_NODE"]  # the tasks per node asked for are the ranks per node
    c_job = c.sbatch(sbatch, "-N2", stage, "--ntasks-per-node=2", env=env_c, timeout=300)
    assert c_job.ok, _explain(c, c_job)
    out_c = c_job.read_output()
    assert "EADDRINUSE" not in out_c and "can't honor" not in out_c, out_c[-3000:]
    steps_c = read_step_logs(str(work / "log-c"))
    assert sorted(steps_c) == [0, 1, 2, 3] and all(len(steps_c[r]) == 3 for r in range(4)), out_c[-3000:]
    for rank in range(4):  # the same plan as job A: its first 3 batches on every rank
        assert [steps_c[rank][s]["keys"] for s in sorted(steps_c[rank])] == [
            steps_a[rank][s]["keys"] for s in sorted(steps_a[rank])[:3]
        ]

    # --- job B: same training, checkpoints every 5 steps, requeued mid-epoch after a checkpoint
    b = c.sbatch(
        sbatch,
        "-N2",
        stage,
        env=_job_env(c, work, dataset, cache_root, "b", "--ckpt-every 5 --step-sleep 0.15"),
        wait=False,
    )
    ckpt = work / "ckpt-b" / "latest.pt"
    deadline = time.monotonic() + 300
    while True:
        logged = read_step_logs(str(work / "log-b"))
        if ckpt.exists() and logged.get(0) and max(logged[0]) >= 8:
            break
        state = c.job_state(b.jobid)
        assert state not in ("COMPLETED", "FAILED", "CANCELLED"), f"job B ended ({state}) before it could be requeued"
        assert time.monotonic() < deadline, f"job B made no progress\n{c.logs_tail()}"
        time.sleep(0.3)
    c.requeue(b.jobid)
    final = c.wait_state(b.jobid, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout=400)
    out = b.read_output()
    assert final == "COMPLETED", f"{final}\n{out[-3000:]}\n{c.logs_tail()}"
    assert "resumed from step" in out, out[-3000:]

    steps_b = read_step_logs(str(work / "log-b"))
    for rank in range(4):
        assert sorted(steps_b[rank]) == sorted(steps_a[rank]), f"rank {rank}: different steps after the requeue"
        for step, entry in steps_a[rank].items():
            assert steps_b[rank][step]["keys"] == entry["keys"], f"rank {rank} step {step}: different batch"
            # model + optimizer were restored too: the losses follow the uninterrupted run
            assert steps_b[rank][step]["loss"] == pytest.approx(entry["loss"], rel=1e-3, abs=1e-3)
    for node in NODES:  # both of job B's prolog runs (first start and requeue) found a warm cache
        assert _warm_report(cache_root, node, b.jobid)["shards_copied"] == 0
