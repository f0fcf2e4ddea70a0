"""Tests of the local SLURM harness itself: the behaviours later end-to-end tests rely on."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from .harness import LocalSlurm

pytestmark = pytest.mark.slurm


def _script(path: Path, body: str) -> Path:
    path.write_text(body)
    path.chmod(0o755)
    return path


# A prolog as a real one must be written: slurmd exports no PATH (bash then falls back to a built-in default
# search path that it does NOT export, so programs it starts see no PATH at all) and no job environment;
# SLURM_CONF is set by slurmd and leads to cluster.env. It writes into the node's emulated local disk.
PER_NODE_PROLOG = r"""#!/bin/bash
. "${SLURM_CONF%/*}/cluster.env"
d="$SLURM_TEST_NODE_ROOT/$SLURMD_NODENAME/local"
case "$(declare -p PATH 2>&1)" in "declare -x"*) path=exported ;; *) path=not-exported ;; esac
printf 'job=%s node=%s nnodes=%s path=%s\n' "$SLURM_JOB_ID" "$SLURMD_NODENAME" "$SLURM_JOB_NUM_NODES" \
  "$path" >> "$d/prolog.$SLURM_JOB_ID"
exit 0
"""

# Fails on a node iff $SLURM_TEST_DIR/fail-prolog.<node> exists, so a test can flip it without a restart.
FLAG_PROLOG = r"""#!/bin/bash
. "${SLURM_CONF%/*}/cluster.env"
[ -e "$SLURM_TEST_DIR/fail-prolog.$SLURMD_NODENAME" ] && exit 1
exit 0
"""


@pytest.mark.timeout(120)
def test_srun_one_task_per_node(slurm_cluster):
    cp = slurm_cluster.srun(
        "-N2", "--ntasks-per-node=1", "bash", "-c", 'echo "$SLURM_PROCID $SLURMD_NODENAME $SLURM_NNODES"', timeout=60
    )
    lines = sorted(cp.stdout.split("\n")[:-1])
    assert len(lines) == 2, cp.stdout
    assert {ln.split()[1] for ln in lines} == {"node1", "node2"}
    assert sorted(ln.split()[0] for ln in lines) == ["0", "1"]
    assert all(ln.split()[2] == "2" for ln in lines)


@pytest.mark.timeout(120)
def test_sbatch_wait_runs_custom_prolog_once_per_node(slurm_cluster_with_prolog, tmp_path):
    c = slurm_cluster_with_prolog(_script(tmp_path / "prolog.sh", PER_NODE_PROLOG))
    # the job checks, on each node, that the prolog's file is in *that node's* local dir
    job = _script(
        tmp_path / "job.sh",
        r"""#!/bin/bash
srun --ntasks-per-node=1 bash -c '. "${SLURM_CONF%/*}/cluster.env";
  cat "$SLURM_TEST_NODE_ROOT/$SLURMD_NODENAME/local/prolog.$SLURM_JOB_ID"'
""",
    )
    out = tmp_path / "job.out"
    # harness wait (0.2 s polling) rather than the CLI's `sbatch --wait`, whose back-off polling adds ~10 s
    r = c.sbatch(job, "-N2", f"--output={out}", wait=True, timeout=90)
    jobid = r.jobid
    assert r.ok, (r.state, r.exit_code, out.read_text())
    for node in c.nodes:
        lines = (c.node_dir(node) / f"prolog.{jobid}").read_text().splitlines()
        assert lines == [f"job={jobid} node={node} nnodes=2 path=not-exported"], lines  # once, here, no PATH
    seen = sorted(out.read_text().splitlines())
    assert seen == [f"job={jobid} node={n} nnodes=2 path=not-exported" for n in ("node1", "node2")]


@pytest.mark.timeout(120)
def test_failing_prolog_drains_node_and_resume_brings_it_back(slurm_cluster_with_prolog, tmp_path):
    c = slurm_cluster_with_prolog(_script(tmp_path / "prolog.sh", FLAG_PROLOG))
    flag = c.dir / "fail-prolog.node2"
    flag.touch()
    job = _script(tmp_path / "job.sh", "#!/bin/bash\necho ran\n")
    r = c.sbatch(job, "-w", "node2", "--no-requeue", wait=True, timeout=60)
    assert r.state != "COMPLETED"
    assert c.wait_node_state("node2", {"drained", "draining"}, timeout=30)
    assert "Prolog error" in c.node_info("node2").get("Reason", "")
    assert c.node_states()["node1"] == "idle"

    flag.unlink()
    c.resume_node("node2")
    assert c.node_states()["node2"] == "idle"
    assert c.srun("-w", "node2", "bash", "-c", "echo $SLURMD_NODENAME").stdout.strip() == "node2"


@pytest.mark.timeout(120)
def test_requeue_runs_job_again_with_restart_count(slurm_cluster, tmp_path):
    c = slurm_cluster
    log = tmp_path / "runs.log"
    job = _script(
        tmp_path / "job.sh",
        r"""#!/bin/bash
echo "job=$SLURM_JOB_ID restart=${SLURM_RESTART_COUNT:-0} node=$SLURMD_NODENAME" >> "$1"
[ "${SLURM_RESTART_COUNT:-0}" -ge 1 ] && exit 0
exec sleep 300
""",
    )
    r = c.sbatch(job, "--requeue", "-N1", script_args=[str(log)], wait=False)
    c.wait_state(r.jobid, "RUNNING", timeout=30)
    deadline = time.monotonic() + 30
    while not log.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert log.exists(), "first run never started"

    c.requeue(r.jobid)
    c.wait_state(r.jobid, {"COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL"}, timeout=60)
    res = c.job_result(r.jobid)
    why = f"{res.info}\nruns:\n{log.read_text()}\noutput:\n{res.read_output()}\n{c.logs_tail(40)}"
    assert res.state == "COMPLETED" and res.exit_code == 0, why
    assert res.info["Restarts"] == "1", why
    runs = [ln.split()[1] for ln in log.read_text().splitlines()]
    assert runs == ["restart=0", "restart=1"], why


@pytest.mark.timeout(120)
def test_second_cluster_coexists_and_survives_stale_pidfiles(slurm_cluster, tmp_path):
    """A leftover cluster must not collide (ports) and stale pidfiles must never kill a foreign process."""
    bystander = subprocess.Popen(["sleep", "300"])
    d = tmp_path / "c2"
    c2 = LocalSlurm(d)
    try:
        c2.up(1)
        assert c2.config["SLURM_TEST_CTLD_PORT"] != slurm_cluster.config["SLURM_TEST_CTLD_PORT"]
        assert c2.srun("-N1", "bash", "-c", "echo $SLURMD_NODENAME").stdout.strip() == "node1"
        # plant stale pidfiles naming a live foreign process, then bring the cluster down and up again in
        # the same dir: neither must touch the bystander, and `up` must clear the leftovers
        c2.down()
        (d / "run").mkdir(parents=True, exist_ok=True)
        for f in ("run/slurmctld.pid", "run/slurmd.node1.pid"):
            (d / f).write_text(f"{bystander.pid}\n")
        (d / "slurm.conf").write_text("# generated by tests/slurm/cluster.sh -- stale\n")
        c2.up(1)
        assert c2.node_states() == {"node1": "idle"}
        assert bystander.poll() is None, "a stale pidfile made cluster.sh kill a foreign process"
    finally:
        c2.down()
        bystander.kill()
        bystander.wait(timeout=10)
    assert not d.exists()
    # the session cluster is unaffected
    assert slurm_cluster.node_states() == {"node1": "idle", "node2": "idle"}


@pytest.mark.timeout(60)
def test_env_strips_inherited_slurm_variables(slurm_cluster, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "999999")  # as if pytest itself ran inside a real allocation
    env = slurm_cluster.env
    assert "SLURM_JOB_ID" not in env
    assert env["SLURM_CONF"] == str(slurm_cluster.dir / "slurm.conf")
    assert os.environ["SLURM_JOB_ID"] == "999999"  # the process environment itself is untouched
