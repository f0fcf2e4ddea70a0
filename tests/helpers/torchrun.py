"""Run a test worker script under torchrun on this machine: N ranks, gloo, a free port.

The tests' one way to start a multi-rank job as a user would (``python -m torch.distributed.run``):
the repository on PYTHONPATH, one OpenMP thread a rank (two cores shared by every rank), output
captured, and a timeout, so a hang fails the test instead of blocking CI."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from helpers.s3server import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout

__all__ = ["ROOT", "torchrun"]


def torchrun(
    script: str, nproc: int, *args: str, timeout: float, env: dict | None = None
) -> subprocess.CompletedProcess:
    """``script`` (a path, or a name in tests/helpers/) on ``nproc`` ranks with ``args``; its
    CompletedProcess (text output). ``env``: variables set on top of this environment's."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        script if os.path.isabs(script) else os.path.join(ROOT, "tests", "helpers", script),
        *args,
    ]
    full_env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", **(env or {})}
    # Its own session: on a timeout the whole job goes, ranks and their loader workers too. Killing
    # torchrun's agent alone left its ranks running as orphans, loading the machine for the
    # tests after it (and their stall reports appeared minutes later).
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
