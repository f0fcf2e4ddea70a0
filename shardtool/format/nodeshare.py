"""Metadata read once per node: the first rank of a job on a node fetches a file, the others
read its copy from node-local memory.

At 1,024 nodes x 8 ranks every rank reads the manifest, the summaries, its range of the lengths
and its shards' sample indexes at start-up: tens of thousands of GETs within seconds, where S3
answers 503 SlowDown above a few thousand a second per prefix. The ranks of one node read the
same files (a node's ranks are one data group), so one fetch per node does.

A read goes through `shared_read`: under a job (a SLURM step, or torchrun's agent), the bytes of
``(filesystem, path, byte range)`` are published in ``/dev/shm/shardtool-<uid>/<job>/`` by the
first rank that takes the file's lock; the others wait on the lock, then read the copy. What it
guards is only the number of requests, never correctness: a copy missing (swept, never written,
/dev/shm unwritable) is fetched again, an error of the fetch is raised in the rank that fetched
(the next one tries itself), and a copy is published by rename, whole or not at all. Outside a
job (one process, in-process simulated ranks) nothing is shared.

On by default for remote datasets; ``SHARDTOOL_NODE_SHARE=1`` shares local paths too (a parallel
filesystem, whose metadata server counts opens), ``=0`` turns it off. Job directories older than
a day are swept by the next job that publishes, so a finished job's copies do not pile up in
memory; sweeping a live job's copy only costs its next reader a fetch.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping

__all__ = ["SHARE_ENV", "job_identity", "shared_read"]

SHARE_ENV = "SHARDTOOL_NODE_SHARE"
SHARE_ROOT = "/dev/shm"
SWEEP_AFTER_S = 24 * 3600


def job_identity(env: Mapping[str, str] | None = None) -> str | None:
    """What the ranks of one job on one node have in common, and no other job: the SLURM job and
    step, or torchrun's agent (the ranks' parent process and its start time). None outside a job."""
    env = os.environ if env is None else env
    if env.get("SLURM_JOB_ID"):
        return f"slurm-{env['SLURM_JOB_ID']}-{env.get('SLURM_STEP_ID', 'x')}"
    if "TORCHELASTIC_RUN_ID" in env:
        agent = os.getppid()
        try:
            with open(f"/proc/{agent}/stat") as f:
                started = f.read().rsplit(")", 1)[1].split()[19]
        except (OSError, IndexError):
            return None
        return f"torchrun-{agent}-{started}"
    return None


def _enabled(local: bool) -> bool:
    said = os.environ.get(SHARE_ENV)
    if said is not None:
        return said == "1"
    return not local


def _job_dir(job: str) -> str | None:
    base = os.path.join(SHARE_ROOT, f"shardtool-{os.getuid()}")
    path = os.path.join(base, job)
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError:
        return None  # no /dev/shm, or not ours: every rank reads for itself
    return path


def _sweep(base: str, mine: str) -> None:
    """Remove job directories under ``base`` not touched for a day, other than ``mine``."""
    now = time.time()
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        path = os.path.join(base, name)
        if path == mine:
            continue
        try:
            if now - os.stat(path).st_mtime > SWEEP_AFTER_S:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


def _copy(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def _publish(folder: str, target: str, data: bytes) -> None:
    """``data`` as ``target``, whole or not at all (a rename); a full /dev/shm publishes nothing."""
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".part-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


_swept = False


def shared_read(
    key: str, read: Callable[[], bytes], *, local: bool = False, env: Mapping[str, str] | None = None
) -> bytes:
    """``read()``'s bytes, fetched by one rank of this job on this node and shared with the
    others (see the module). ``key`` names what is read (filesystem, path, byte range);
    ``local``: a path on this machine's filesystem (shared only under ``SHARDTOOL_NODE_SHARE=1``)."""
    global _swept
    job = job_identity(env) if _enabled(local) else None
    folder = _job_dir(job) if job is not None else None
    if folder is None:
        return read()
    target = os.path.join(folder, hashlib.sha256(key.encode()).hexdigest()[:40])
    data = _copy(target)
    if data is not None:
        return data
    try:
        fd = os.open(target + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return read()
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        data = _copy(target)  # published while this rank waited for the lock
        if data is None:
            data = read()  # an error here is this rank's; the next one to take the lock tries itself
            _publish(folder, target, data)
    finally:
        os.close(fd)  # releases the lock
    if not _swept:
        _swept = True
        _sweep(os.path.dirname(folder), folder)
    return data
