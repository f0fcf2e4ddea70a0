"""Fork the ranks of a gloo job from one process and time each rank's exit (tests' launcher).

torch is imported once, in the launcher, and every rank is forked from it: a fresh interpreter
per rank would spend seconds per rank importing torch on a busy machine. torchrun's agent would
also kill the survivors of a failed rank for us and hide whether they fail on their own.

A job is ``{"world": N, "out": DIR, "limit": SECONDS, "argv": [...], "env": {...}}``: rank r runs
``rank_main(["--out", DIR, *argv])`` in its own session, with RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT and the job's ``env`` set, its output in DIR/rank<r>.log.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable

__all__ = ["free_port", "run_job", "run_jobs_file"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_rank(rank: int, job: dict, port: int, rank_main: Callable[[list[str]], int]) -> int:
    pid = os.fork()
    if pid:
        return pid
    # The rank: its own session (so a kill reaches its DataLoader workers), its own log.
    code = 1
    out = job["out"]
    try:
        os.setsid()
        fd = os.open(os.path.join(out, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        local = int(job.get("env", {}).get("LOCAL_WORLD_SIZE", job["world"]))
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(job["world"]),
            LOCAL_RANK=str(rank % local),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            **job.get("env", {}),
        )
        code = rank_main(["--out", out, *job["argv"]])
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_job(job: dict, rank_main: Callable[[list[str]], int]) -> list[list]:
    """Fork the job's ranks, wait up to its limit (killing what is left), return [returncode, seconds] per rank.

    A returncode of None means the rank was still running at the limit; -N means killed by signal N.
    """
    world, out, limit = job["world"], job["out"], job["limit"]
    os.makedirs(out, exist_ok=True)
    port = free_port()
    began = time.monotonic()
    pids = [_start_rank(r, job, port, rank_main) for r in range(world)]
    done: dict[int, list] = {}
    while len(done) < world and time.monotonic() - began < limit:
        for r, pid in enumerate(pids):
            if r in done:
                continue
            got, status = os.waitpid(pid, os.WNOHANG)
            if got:
                done[r] = [os.waitstatus_to_exitcode(status), time.monotonic() - began]
        time.sleep(0.05)
    for r, pid in enumerate(pids):
        if r not in done:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            done[r] = [None, time.monotonic() - began]
    return [done[r] for r in range(world)]


def run_jobs_file(path: str, rank_main: Callable[[list[str]], int]) -> int:
    """Run the jobs listed in the JSON file ``path`` one after another; print one JSON line of
    results per job: ``{"out": DIR, "ranks": [[returncode, seconds], ...]}``."""
    with open(path) as f:
        jobs = json.load(f)
    for job in jobs:
        print(json.dumps({"out": job["out"], "ranks": run_job(job, rank_main)}), flush=True)
    return 0
