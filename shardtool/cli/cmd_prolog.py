"""``shardtool prolog``: stage what a SLURM job asks for into this node's shared cache (one prolog, every job)."""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys

from ._args import size_arg

HELP = "run from a SLURM prolog: stage the data the job asks for (sbatch --comment) into this node's cache"
DESCRIPTION = """\
One prolog serves every job of a shared cluster. The job says what to stage in its comment, which
Slurm gives the prolog (SLURM_JOB_COMMENT; else `scontrol show job`):

  sbatch --comment 'shardtool:/lustre/me/web-v3' train.sbatch
  sbatch --comment 'shardtool:mix.json' ...          (a mixture file: every source; relative to the job's dir)
  sbatch --comment 'shardtool:{"url": "s3://b/ds", "mesh": "pp=2,dp=4,tp=2", "dp_dim": "dp",
                              "ranks_per_node": 8, "best_effort": true}' ...
  (JSON keys: url; as ShardedLoader gets them mesh, dp_dim, dp_size, ranks_per_node, nodes_per_group;
   best_effort: stage what fits the budget rather than fail the node; max_bytes: the job's cap per
   dataset on this node)

A job that asks for nothing gets nothing staged. This node's cache is CACHE_ROOT/$SLURMD_NODENAME; its
rank is the position of $SLURMD_NODENAME in the job's node list (`scontrol show hostnames`), the order
SLURM gives SLURM_NODEID to the job's tasks. The options are the admin's: the job cannot change them.

The cache holds many datasets at once. Each job's request is recorded in CACHE_DIR/jobs/<job>.json;
under a budget, versions no running job on the node asked for are evicted first (least recently used
first), and a shard being read never is. A job is running while `squeue` lists it; records of jobs it
no longer lists are removed (if squeue cannot answer, every record counts as running).

exit codes (SLURM drains a node on a non-zero prolog exit, so only a fault of this node is one):
  0  staged; or nothing asked; or the job's own mistake (no dataset at its URL, a bad layout or request):
     written to CACHE_DIR/jobs/<job>.json, where the job's ShardedLoader finds it and raises it; or a storage
     outage (the loader fetches on demand); or the source is gone but this node's cache holds a complete
     version for the URL (the job reads it; a warning)
  3  fault of this node: cache disk missing, read-only or full, or the budget below this node's share
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-root", required=True, help="node-local cache root; this node's cache is ROOT/<node name>")
    p.add_argument("--scontrol", default="/usr/bin/scontrol", help="absolute path of scontrol (a prolog has no PATH)")
    p.add_argument("--squeue", default="/usr/bin/squeue", help="absolute path of squeue (which jobs still run)")
    p.add_argument(
        "--comment-from",
        choices=("auto", "env", "scontrol"),
        default="auto",
        help="where the job's comment is read: SLURM_JOB_COMMENT (env), `scontrol show job` (scontrol), "
        "or the environment and scontrol when it is not set there (auto, default)",
    )
    p.add_argument("--jobs", "-j", type=int, default=8, help="concurrent transfers (default 8)")
    p.add_argument("--max-bytes", type=size_arg, help="most bytes the node's cache may hold (e.g. 1500G)")
    p.add_argument("--min-free", type=size_arg, help="bytes to leave free on the cache's disk (e.g. 50G)")
    p.add_argument(
        "--best-effort",
        action="store_true",
        help="for every job: if its shards do not fit, stage what fits (a job may ask for it itself)",
    )
    p.add_argument("--timeout", type=float, help="overall deadline of the staging in seconds")
    p.add_argument("--durable", action="store_true", help="fsync every shard before publishing it")
    p.add_argument("--mode", default="0644", help="octal mode of what is written (default 0644)")
    p.add_argument("--group", help="group of what is written (with --mode 0640: only its jobs can read)")


def log(env, msg: str) -> None:
    print(
        f"shardtool-prolog[job {env.get('SLURM_JOB_ID', '?')} on {env.get('SLURMD_NODENAME', '?')}]: {msg}",
        file=sys.stderr,
        flush=True,
    )


def _slurm(argv: list[str], timeout: float = 30) -> str | None:
    """stdout of a SLURM client command, None if it fails (never raises: the prolog must not)."""
    try:
        cp = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={k: v for k, v in os.environ.items() if k == "SLURM_CONF" or not k.startswith("SLURM_")},
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return cp.stdout if cp.returncode == 0 else None


def job_comment(args, env) -> str | None:
    from ..cache.request import comment_from_env, comment_from_scontrol

    found = comment_from_env(env)
    if found is not None or args.comment_from == "env":
        return found
    out = _slurm([args.scontrol, "show", "job", "-o", env["SLURM_JOB_ID"]])
    return comment_from_scontrol(out.splitlines()[0]) if out and out.strip() else None


def active_jobs(args) -> set[str] | None:
    """Job ids SLURM lists (any state before finished); None when it cannot say."""
    out = _slurm([args.squeue, "--noheader", "--format=%A"])
    return None if out is None else {line.strip() for line in out.splitlines() if line.strip()}


def _layout_args(request) -> argparse.Namespace:
    """The request's layout as `shardtool warm`'s options (one way of reading a layout)."""
    return argparse.Namespace(
        mesh=request.mesh,
        dp_dim=request.dp_dim,
        dp_size=request.dp_size,
        ranks_per_node=request.ranks_per_node,
        nodes_per_group=request.nodes_per_group,
    )


def place(args, env, request):
    """(Placement, DataLayout or None) of this node in the job, from its node list and request."""
    from ..plan import LayoutError, node_placement
    from ._layout import data_layout_of
    from .cmd_warm import mesh_placement

    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    node = env.get("SLURMD_NODENAME")
    out = _slurm([args.scontrol, "show", "hostnames", nodelist]) if nodelist else None
    if out is None:
        raise RuntimeError(f"cannot expand the job's node list {nodelist!r} with {args.scontrol} show hostnames")
    hosts = [h.strip() for h in out.splitlines() if h.strip()]
    if node not in hosts:
        raise RuntimeError(f"{node} is not in the job's node list {nodelist} ({', '.join(hosts)})")
    placement = node_placement(len(hosts), hosts.index(node), request.ranks_per_node, env={})
    if not request.data_layout_given:
        return placement, None
    ns = _layout_args(request)
    placement = mesh_placement(ns, placement)
    try:
        return placement, data_layout_of(ns, placement)[0]
    except LayoutError as e:
        raise LayoutError(f"{e} ({placement.describe()})") from None


def sources_of(report) -> list[dict]:
    reports = getattr(report, "reports", None)
    items = reports.values() if reports is not None else [report]
    return [
        {
            "url": r.url,
            "version": r.version,
            "status": r.status,
            "error": r.error or ("; ".join(r.warnings) if r.warnings else None),
        }
        for r in items
    ]


def _report_path(cache_dir: str, job: str) -> str:
    """The warm's JSON report, beside the node's cache: CACHE_ROOT/<node>.warm-<job>.json."""
    return f"{cache_dir}.warm-{job}.json"


def _claims(cache_dir: str, url: str) -> list[dict]:
    """Before warming, the versions the job's URL (every source of a mixture) served last: recorded
    at once, so that a concurrent prolog's budget spares them."""
    from ..cache.cachedir import recorded_version
    from ..plan.mixture import Mixture, MixtureError, is_mixture_file

    urls = [url]
    if is_mixture_file(url):
        try:
            urls = [s.url for s in Mixture.from_file(url).sources]
        except MixtureError:
            urls = []
    found = ((u, recorded_version(cache_dir, u)) for u in urls)
    return [{"url": u, "version": v} for u, v in found if v]


def _running_jobs_versions(args, cache_dir: str, job: str) -> set[str]:
    """Versions the other running jobs on this node asked for; drops the records of finished jobs."""
    from ..cache.jobs import live_versions, read_job_records, remove_job_records, stale_jobs

    records = read_job_records(cache_dir)
    active = active_jobs(args)
    stale = stale_jobs(records, active, keep=job)
    remove_job_records(cache_dir, stale)
    for old in stale:  # and their warm reports
        with contextlib.suppress(OSError):
            os.unlink(_report_path(cache_dir, old))
    return live_versions({j: r for j, r in records.items() if j not in stale and j != job}, active)


def run(args) -> int:
    from ..cache.errors import LocalFault
    from ..cache.jobs import prolog_exit_code, write_job_record
    from ..cache.request import RequestError, parse_request
    from ..cache.warmer import check_cache_dir
    from ..plan import LayoutError
    from .cmd_warm import perms_from

    env = os.environ
    job, node = env.get("SLURM_JOB_ID"), env.get("SLURMD_NODENAME")
    if not job or not node:
        log(env, "SLURM_JOB_ID/SLURMD_NODENAME not set: not run by slurmd; nothing staged")
        return 0
    cache_dir = os.path.join(args.cache_root, node)  # emulated nodes may share a filesystem: key on the node
    comment = job_comment(args, env)
    problem: RequestError | LayoutError | None = None
    try:
        request = parse_request(comment, workdir=env.get("SLURM_JOB_WORK_DIR"))
    except RequestError as e:
        request, problem = None, e
    if request is None and problem is None:
        log(env, "the job asks for nothing to stage (no 'shardtool:' in its comment)")
        return 0
    try:
        perms = perms_from(args)
        check_cache_dir(cache_dir, perms)  # a fault of this node, whatever the job asked
    except ValueError as e:
        log(env, f"bad prolog option (the admin's; nothing staged): {e}")
        return 0
    except LocalFault as e:
        log(env, f"local fault: {e}")
        return prolog_exit_code("local_fault")
    record: dict[str, object] = {
        "node": node,
        "comment": comment,
        "request": request.to_dict() if request else None,
        "sources": [],
    }
    placement = data = None
    if problem is None:
        try:
            placement, data = place(args, env, request)
        except LayoutError as e:
            problem = e
        except RuntimeError as e:  # SLURM could not place the node: not the job's or the node's fault
            return _finish(env, cache_dir, job, record, "remote_failed", str(e), perms)
    if problem is not None:
        if request is not None:  # a layout the job's nodes cannot take: the finding names its dataset
            record["sources"] = [{"url": request.url, "version": None, "status": "usage_error", "error": str(problem)}]
        return _finish(env, cache_dir, job, record, "usage_error", str(problem), perms)
    if request is None:  # not reached: without a problem the comment held a request (or returned above)
        raise RuntimeError("prolog: no staging request, and no problem reading one")

    live = _running_jobs_versions(args, cache_dir, job)
    try:
        write_job_record(
            cache_dir, job, {**record, "status": "staging", "sources": _claims(cache_dir, request.url)}, perms=perms
        )
    except OSError as e:
        log(env, f"local fault: cannot write the job's record in {cache_dir}: {e}")
        return prolog_exit_code("local_fault")
    report = _warm(args, request, cache_dir, placement, data, live, perms)
    if request.mesh or request.nodes_per_group != 1:
        from ._layout import describe_layout

        for r in getattr(report, "reports", {"": report}).values():  # as `shardtool warm` reports a mesh
            if r.data_layout is not None:
                r.data_layout.update(describe_layout(_layout_args(request)))
    record["sources"] = sources_of(report)
    warned = report.warnings
    message = report.error or ("; ".join(warned) if warned else None)
    try:
        from ..format.atomic import atomic_write_bytes

        atomic_write_bytes(_report_path(cache_dir, job), report.to_json().encode())
    except OSError as e:
        log(env, f"cannot write the warm report: {e}")
    for line in report.summary().splitlines():
        log(env, line)
    return _finish(env, cache_dir, job, record, report.status, message, perms)


def _warm(args, request, cache_dir, placement, data, live, perms):
    from ..cache import RetryPolicy, warm
    from ..cache.mixwarm import warm_mixture
    from ..plan.mixture import is_mixture_file

    # a mixture file: every source's range for this node, one report
    staging = warm_mixture if is_mixture_file(request.url) else warm
    return staging(
        request.url,
        cache_dir,
        placement=placement,
        data_layout=data,
        jobs=args.jobs,
        max_bytes=args.max_bytes,
        min_free=args.min_free,
        best_effort=args.best_effort or request.best_effort,
        timeout=args.timeout,
        durable=args.durable,
        retry=RetryPolicy(),
        perms=perms,
        progress=False,
        live=live,
        stage_bytes=request.max_bytes,
        log=lambda msg: print(f"shardtool warm: {msg}", file=sys.stderr),
    )


def _finish(env, cache_dir, job, record, status, message, perms) -> int:
    from ..cache.jobs import finding_severity, prolog_exit_code, write_job_record

    severity = finding_severity(status, bool(message))
    record.update(status=status, severity=severity, finding=message)
    if severity:
        log(env, f"{severity} for the job ({status}): {message}")
    try:
        path = write_job_record(cache_dir, job, record, perms=perms)
        log(env, f"status {status}; record {path}")
    except OSError as e:
        log(env, f"local fault: cannot write the job's record: {e}")
        return prolog_exit_code("local_fault")
    return prolog_exit_code(status)
