"""Which jobs on a node asked for what, and what the prolog found for each (docs/architecture.md §3).

Many jobs share a node's cache. The prolog leaves one record per job in the node's cache::

    CACHE_DIR/jobs/<SLURM_JOB_ID>.json
      {"job", "node", "comment", "request", "status", "severity", "finding", "warnings",
       "sources": [{"url", "version", "status", "error"}], "written"}

Two readers:

- Eviction. A version some running job on the node asked for is evicted only after every version
  no running job asked for (:func:`live_versions`). A job is *running* while SLURM lists it (any
  state before it finished: ``squeue``); the next prolog on the node removes the records of jobs
  SLURM no longer lists (an epilog may remove its job's record sooner). When SLURM cannot be asked,
  every record counts as running: nothing a job may be reading is evicted on a guess.
- The job's loader. A job's own mistake (no dataset at its URL, a bad layout, a malformed request)
  never fails the prolog, which would drain the node; it is written here, and ShardedLoader, seeing
  ``SLURM_JOB_ID`` and such a finding for its dataset, raises :class:`StagingError` naming it
  (:func:`check_job_finding`).

The decisions (:func:`live_versions`, :func:`stale_jobs`, :func:`prolog_exit_code`,
:func:`finding_severity`) are pure functions.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Iterable, Mapping

from .cachedir import normalize_url
from .errors import EXIT_LOCAL, EXIT_OK, UsageError
from .perms import DEFAULT_PERMS, Perms
from .store import write_small

JOBS_DIR = "jobs"

# Statuses a staging ends in, for one source or the whole request: the warm's (ok, partial,
# remote_failed, usage_error, local_fault) and "cached" (the source is gone or unreachable, but
# this node's cache holds a complete version for the URL).
ERROR_STATUSES = frozenset({"usage_error"})
WARNING_STATUSES = frozenset({"remote_failed", "partial", "cached"})


class StagingError(UsageError):
    """The prolog found the job's staging request unusable (the job's mistake, not the node's)."""


# ------------------------------------------------------------------ decisions (pure)
def prolog_exit_code(status: str) -> int:
    """A prolog exits non-zero only for a fault of the node (SLURM drains a node on any prolog
    failure): its cache disk missing, read-only or full, or the budget below the node's share."""
    return EXIT_LOCAL if status == "local_fault" else EXIT_OK


def finding_severity(status: str, warned: bool = False) -> str | None:
    """'error' (the loader raises it), 'warning' (the loader warns, then reads or fetches), or None."""
    if status in ERROR_STATUSES:
        return "error"
    if status in WARNING_STATUSES or warned:
        return "warning"
    return None


def live_versions(records: Mapping[str, dict], active: Iterable[str] | None) -> set[str]:
    """Versions some running job asked for: those of the records whose job is ``active`` (every
    record when ``active`` is None, i.e. SLURM could not say)."""
    live = None if active is None else {str(j) for j in active}
    out: set[str] = set()
    for job, rec in records.items():
        if live is None or str(job) in live:
            out.update(s["version"] for s in rec.get("sources", ()) if s.get("version"))
    return out


def stale_jobs(records: Mapping[str, dict], active: Iterable[str] | None, *, keep: str | None = None) -> list[str]:
    """Records of jobs SLURM no longer lists (none when SLURM could not say); never ``keep``."""
    if active is None:
        return []
    live = {str(j) for j in active}
    return sorted(j for j in records if j not in live and j != keep)


# ------------------------------------------------------------------ records on disk
def job_record_path(cache_dir: str, job_id: str | int) -> str:
    job = str(job_id)
    if not job or not all(c.isalnum() or c in "_-." for c in job) or job.startswith("."):
        raise ValueError(f"not a job id: {job_id!r}")
    return os.path.join(cache_dir, JOBS_DIR, f"{job}.json")


def write_job_record(cache_dir: str, job_id: str | int, record: dict, *, perms: Perms = DEFAULT_PERMS) -> str:
    """Publish the job's record atomically, readable by the job's user (the cache's mode)."""
    path = job_record_path(cache_dir, job_id)
    perms.makedirs(os.path.dirname(path))
    body = {**record, "job": str(job_id), "written": time.time()}
    write_small(path, json.dumps(body, indent=1).encode(), perms=perms)
    return path


def read_job_record(cache_dir: str, job_id: str | int) -> dict | None:
    try:
        with open(job_record_path(cache_dir, job_id)) as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def read_job_records(cache_dir: str) -> dict[str, dict]:
    d = os.path.join(cache_dir, JOBS_DIR)
    try:
        names = sorted(os.listdir(d))
    except OSError:
        return {}
    out = {}
    for name in names:
        if name.endswith(".json") and not name.startswith("."):
            rec = read_job_record(cache_dir, name[: -len(".json")])
            if rec is not None:
                out[name[: -len(".json")]] = rec
    return out


def remove_job_records(cache_dir: str, jobs: Iterable[str]) -> None:
    for job in jobs:
        try:
            os.unlink(job_record_path(cache_dir, job))
        except (OSError, ValueError):
            pass


# ------------------------------------------------------------------ the loader's side
_warned: set[tuple[str, str]] = set()


def _matches(source: dict, url: str) -> bool:
    return bool(source.get("url")) and normalize_url(source["url"]) == normalize_url(url)


def check_job_finding(cache_dir: str, url: str, env: Mapping[str, str]) -> None:
    """Raise the prolog's finding for ``url`` in this SLURM job, if it found the job's request
    unusable; warn (once per process) if it found something the job should know (source gone or
    unreachable, not everything staged). Nothing outside a SLURM job or without a record."""
    job = env.get("SLURM_JOB_ID")
    if not job or not cache_dir:
        return
    try:
        rec = read_job_record(cache_dir, job)
    except ValueError:
        return
    if rec is None:
        return
    where = f"{job_record_path(cache_dir, job)} (node {rec.get('node', '?')})"
    sources = rec.get("sources") or []
    mine = [s for s in sources if _matches(s, str(url))]
    if rec.get("severity") == "error":
        bad = [s for s in mine if finding_severity(s.get("status", "")) == "error"]
        if bad or not sources:  # this dataset failed, or the request itself did
            what = bad[0].get("error") if bad else rec.get("finding")
            raise StagingError(
                f"the SLURM prolog could not stage this job's data: {what} "
                f"(job {job}'s request {rec.get('comment')!r}; finding in {where})"
            )
    notes = [s.get("error") for s in mine if finding_severity(s.get("status", "")) == "warning" and s.get("error")]
    if not mine and rec.get("severity") and rec.get("finding"):
        notes = [rec["finding"]]
    for note in notes:
        if (where, note) not in _warned:
            _warned.add((where, note))
            warnings.warn(f"SLURM prolog for job {job}: {note} (finding in {where})", RuntimeWarning, stacklevel=3)


__all__ = [
    "JOBS_DIR",
    "StagingError",
    "check_job_finding",
    "finding_severity",
    "job_record_path",
    "live_versions",
    "prolog_exit_code",
    "read_job_record",
    "read_job_records",
    "remove_job_records",
    "stale_jobs",
    "write_job_record",
]
