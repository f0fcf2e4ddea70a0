"""Running pack jobs: in this process for one job, else one process per job.

A worker that dies without a result (the OOM killer, a SIGKILL) fails the pack with an error
naming it; ``multiprocessing.Pool`` would wait for its lost task forever.
"""

from __future__ import annotations

import queue as queue_mod
from typing import TYPE_CHECKING

from ..format.errors import ShardtoolError
from .progress import Progress
from .worker import Job, JobResult, run_job

if TYPE_CHECKING:
    from multiprocessing.queues import Queue

_QUEUE: Queue[tuple[int, int]] | None = None  # a worker process's progress queue to the parent


def _init_worker(q: Queue[tuple[int, int]]) -> None:
    global _QUEUE
    _QUEUE = q


def _report(n: int, b: int) -> None:
    if _QUEUE is None:
        raise RuntimeError("pack progress reported outside a pack worker (_init_worker was not called)")
    _QUEUE.put((n, b))


def _worker_main(job: Job, q, conn) -> None:
    _init_worker(q)
    if job.tokenize is not None:
        # One encoding thread per pack worker: the workers are the parallelism (and tokenizers
        # would otherwise start a thread per core in every one of them).
        import os

        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    out: tuple[str, JobResult | BaseException]
    try:
        out = ("ok", run_job(job, _report))
    except BaseException as e:  # sent to the parent, which re-raises it
        out = ("err", e)
    try:
        conn.send(out)
    except Exception as e:  # an unpicklable error: send its text
        conn.send(("err", ShardtoolError(f"pack worker {job.worker}: {type(out[1]).__name__}: {out[1]} ({e})")))
    conn.close()


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def run_jobs(jobs: list[Job], bar: Progress) -> list[JobResult]:
    """The results of ``jobs``, in job order (see the module docstring)."""
    if len(jobs) == 1:
        return [run_job(jobs[0], bar.update)]
    import multiprocessing as mp
    from multiprocessing.connection import wait

    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context("spawn")
    q = ctx.Queue()
    procs, conns, results = [], [], {}

    def drain() -> None:
        while True:
            try:
                n, b = q.get_nowait()
            except queue_mod.Empty:
                return
            bar.update(n, b)

    try:
        for job in jobs:
            r, w = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker_main, args=(job, q, w), daemon=True)
            p.start()
            w.close()
            procs.append(p)
            conns.append(r)
        pending = set(range(len(jobs)))
        while pending:
            wait([conns[i] for i in pending] + [procs[i].sentinel for i in pending], timeout=0.1)
            drain()
            for i in sorted(pending):
                if conns[i].poll():
                    try:
                        kind, value = conns[i].recv()
                    except EOFError:
                        kind, value = "died", None
                    if kind == "ok":
                        results[i] = value
                        pending.discard(i)
                        continue
                    if kind == "err":
                        raise value
                if not procs[i].is_alive() and i not in results:
                    procs[i].join()
                    raise ShardtoolError(
                        f"pack worker {jobs[i].worker} died ({_exit_text(procs[i].exitcode)}) "
                        "before finishing; nothing was published"
                    )
        drain()
        return [results[i] for i in range(len(jobs))]
    except BaseException:
        for p in procs:
            if p.is_alive():
                p.kill()
        raise
    finally:
        for p in procs:
            p.join()
