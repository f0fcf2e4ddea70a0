"""Rank processes of the node benchmark: started fresh, collected, killed when they hang.

Spawned, not forked: the parent has usually run torch ops by then (`measure_step_ms` times a
tiny model), and a forked child inherits the OpenMP thread pool's bookkeeping without its
threads, so its first parallel op (say, the ``torch.zeros`` of a padded batch in the webdataset
collate) waits forever on a futex. A spawned rank starts with no pool at all, as a torchrun rank
does. Each rank leads its own process group, so a hung rank is killed together with its loader
workers, and a run never outlives its timeout.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any

POLL_S = 0.5


def run_ranks(
    fn: Callable[..., Any], ranks: int, args: tuple, *, timeout: float
) -> tuple[dict[int, Any], dict[int, str]]:
    """``fn(rank, *args)`` in ``ranks`` fresh processes at once; (results by rank, failures by rank).

    A rank that raises, exits without a result or is still running after ``timeout`` seconds is
    a failure, said in words; every rank still alive at the end is killed with its process group.
    ``fn`` must be importable by name (a module-level function): the children are spawned.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(fn, r, args, results), name=f"bench-rank-{r}") for r in range(ranks)]
    done: dict[int, Any] = {}
    failed: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.start()
        while len(done) + len(failed) < ranks:
            try:
                rank, ok, value = results.get(timeout=POLL_S)
                (done if ok else failed)[rank] = value
                continue
            except queue_mod.Empty:
                pass
            for r, p in enumerate(procs):
                # A result may still be in the pipe of a rank that just exited: ask the queue once more.
                if r not in done and r not in failed and p.exitcode is not None and results.empty():
                    failed[r] = f"exited with code {p.exitcode} without a result"
            if time.monotonic() > deadline:
                for r, p in enumerate(procs):
                    if r not in done and r not in failed:
                        failed[r] = f"timed out: no result after {timeout:g} s (pid {p.pid}; killed with its workers)"
    finally:
        for p in procs:
            _kill_group(p)
        results.close()
    return done, failed


def _kill_group(p) -> None:
    if p.pid is None:
        return  # never started
    if p.exitcode is None:
        p.join(5.0)  # a rank that sent its result exits by itself
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, signal.SIGKILL)  # the rank's loader workers too, whether it exited or not
    if p.exitcode is None:
        p.kill()  # not yet its own group leader
    p.join(5.0)


def _child(fn: Callable[..., Any], rank: int, args: tuple, results) -> None:
    os.setpgrp()
    # The rank's own worker processes start as a torchrun rank's would: the platform's default
    # way (a spawned process would otherwise spawn them too, and webdataset's loader with it).
    mp.set_start_method(mp.get_all_start_methods()[0], force=True)
    try:
        value, ok = fn(rank, *args), True
    except Exception as e:
        value, ok = f"{type(e).__name__}: {e}\n{traceback.format_exc()}", False
    results.put((rank, ok, value))
    results.close()
    results.join_thread()
