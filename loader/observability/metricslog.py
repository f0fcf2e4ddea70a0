"""Metric lines on node-local disk every N steps, and the optional cross-rank summary.

Each rank appends one JSON line per ``metrics_every`` steps to its own file,
``<dir>/<host>-rank<rank>.jsonl``: one small append every N steps and at each pass's end (its
last steps' costs and step times would be in no line), never one per step, and by
default on node-local disk (under the cache directory, else ``$TMPDIR``), in a directory per run
so that ``shardtool stats`` never mixes two jobs. The run id comes from the scheduler or launcher
(SLURM job, torchrun run id, else the rendezvous address); without any, a single process
makes its own and the ranks of a launch share ``local``.

``metrics_reduce``: every N steps, one all-gather of five numbers per rank gives min / median /
max of wait and throughput across ranks and names the slowest rank and its node; rank 0 logs it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import tempfile
import time
import weakref
from collections.abc import Mapping

import numpy as np

log = logging.getLogger("shardtool.loader.metrics")
LINE_VERSION = 1


def run_id(env: Mapping[str, str], world_size: int, pid: int, now: float) -> str:
    """The id shared by every rank of this job: the scheduler's or launcher's, else a local one."""
    job = env.get("SLURM_JOB_ID", "").strip()
    if job:
        step = env.get("SLURM_STEP_ID", "").strip()
        return f"slurm-{job}" + (f".{step}" if step else "")
    elastic = env.get("TORCHELASTIC_RUN_ID", "").strip()
    if elastic and elastic != "none":
        return f"torchrun-{elastic}"
    if world_size == 1:
        return time.strftime("%Y%m%d-%H%M%S", time.localtime(now)) + f"-{pid}"
    port = env.get("MASTER_PORT", "").strip()  # a static rendezvous: the same on every node
    return f"master-{env.get('MASTER_ADDR', '').strip()}-{port}" if port else "local"


def default_dir(metrics_dir: str | None, cache_dir: str | None, run: str, env: Mapping[str, str]) -> str:
    """Explicit directory as given; else node-local: the cache directory, else the temp directory."""
    if metrics_dir:
        return os.path.abspath(metrics_dir)
    base = os.path.join(cache_dir, "metrics") if cache_dir else os.path.join(_tmpdir(env), "shardtool-metrics")
    return os.path.join(os.path.abspath(base), _safe(run))


def _tmpdir(env: Mapping[str, str]) -> str:
    return env.get("TMPDIR") or tempfile.gettempdir()


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-._" else "_" for c in name) or "run"


class MetricsFile:
    """One rank's JSONL file: created on the first line, then kept open for appends (opening a
    file per line cost ten times the write)."""

    def __init__(self, directory: str, host: str, rank: int):
        self.directory = directory
        self.path = os.path.join(directory, f"{_safe(host)}-rank{rank:05d}.jsonl")
        self._fd: list[int] = []  # in a list, so the finalizer closes whatever is open then
        self._failed = False
        self._finalizer = weakref.finalize(self, _close, self._fd)

    def append(self, line: dict) -> None:
        if self._failed:
            return
        data = (json.dumps(line, separators=(",", ":")) + "\n").encode()
        try:
            if not self._fd:
                os.makedirs(self.directory, exist_ok=True)
                self._fd.append(os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644))
            os.write(self._fd[0], data)  # one write of a whole line: lines never interleave
        except OSError as e:  # metrics must never stop training; say so once
            log.warning("cannot write loader metrics to %s (%s); continuing without them", self.path, e)
            self._failed = True

    def close(self) -> None:
        self._finalizer()


def _close(fds: list[int]) -> None:
    while fds:
        os.close(fds.pop())


def host_name() -> str:
    return socket.gethostname().split(".")[0] or "localhost"


# ---------------------------------------------------------------------- across ranks
def reduce_ranks(window: dict, *, rank: int, world_size: int, node: int) -> dict | None:
    """All-gather this window's wait and throughput; the summary on every rank (None: no group)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_world_size() != world_size or dist.get_rank() != rank:
        return None  # an explicit layout that is not the process group's
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    mine = torch.tensor(
        [window["wait_s"], window["seconds"], window["tokens"], window["samples"], node],
        dtype=torch.float64,
        device=device,
    )
    every = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(every, mine)
    table = torch.stack(every).cpu().numpy()
    return summarize_ranks(table)


def summarize_ranks(table: np.ndarray) -> dict:
    """Rows (wait_s, seconds, tokens, samples, node) per rank -> min/median/max and the slowest rank.

    The slowest rank is the one that waited longest for data: in synchronous training every rank
    steps at the pace of the slowest, so its wait, not its throughput, gives it away.
    """
    wait, seconds, tokens = table[:, 0], np.maximum(table[:, 1], 1e-12), table[:, 2]
    frac, tps = wait / seconds, tokens / seconds
    slowest = int(np.lexsort((tps, -frac))[0])  # most waiting; ties: the lowest throughput
    stats = lambda x: {"min": float(x.min()), "median": float(np.median(x)), "max": float(x.max())}  # noqa: E731
    return {
        "wait_fraction": stats(frac),
        "tokens_per_s": stats(tps),
        "slowest_rank": slowest,
        "slowest_node": int(table[slowest, 4]),
        "slowest_wait_fraction": float(frac[slowest]),
    }


def format_summary(s: dict, step: int) -> str:
    w, t = s["wait_fraction"], s["tokens_per_s"]
    return (
        f"loader step {step}: data wait min/median/max {w['min']:.1%}/{w['median']:.1%}/{w['max']:.1%}, "
        f"tokens/s {t['min']:,.0f}/{t['median']:,.0f}/{t['max']:,.0f}; slowest rank {s['slowest_rank']} "
        f"on node {s['slowest_node']} (waited {s['slowest_wait_fraction']:.1%} of the time)"
    )
