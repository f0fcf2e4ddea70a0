"""``shardtool warm``: copy this node's shards into a node-local cache (run it in a SLURM prolog)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from ._args import add_storage_option_argument, size_arg, storage_options_from
from ._layout import LAYOUT_HELP, add_layout_arguments, data_layout_of, describe_layout, parsed_mesh

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..cache import WarmReport
    from ..cache.mixwarm import MixtureWarmReport

HELP = "copy exactly this node's shards (verified, atomic, parallel) into a node-local cache"
DESCRIPTION = """\
Copy into CACHE_DIR exactly the shards this node's ranks will read, plus the manifest, the lengths
file and those shards' sample indexes, so the loader (cache_dir=...) starts and runs from the cache
even if the source is unreachable. The node's shards come from the same pure function the loader
uses; they depend only on the dataset and the layout (no seed or batching config).

A mixture file (mix.json, see `shardtool plan --help`) warms every source's range for this node in
one call, one line per source; with a budget, no source's warm evicts another's shards.

Node layout: --nodes/--node-rank/--ranks-per-node, else SLURM_JOB_NUM_NODES, SLURM_NODEID and
SLURM_NTASKS_PER_NODE or SLURM_GPUS_ON_NODE. --all warms every shard.

Data layout: give the warm the same description the loader gets (ShardedLoader's dp_size= or
mesh= and dp_dim=, and nodes_per_group=), so it caches what this node's ranks will read; pure data parallelism (every
rank its own DP rank, DDP/FSDP) needs none.
{layout}
With --mesh and no --ranks-per-node, ranks per node are the mesh's ranks over the nodes when
nothing says more than one (under torchrun in srun, SLURM counts one task per node).

Each shard goes to a temp file (copied in the kernel from a local or parallel filesystem, as cp
does), is checked against the manifest's size and hash and renamed; with --durable it is also
fsynced first. Without --durable a shard the machine crashed before writing back is hashed again
before it is trusted, so nothing lost is ever served. A rerun skips what is already there and
verified. Concurrent warmers (and a loader's fetch-on-miss) share per-shard flock locks.

A compressed dataset (pack --compression) is verified as stored, then decompressed into the cache
as plain Arrow shards (read at the speed of a plain dataset; the budget counts plain bytes, and
-j shards decompress at once); --keep-compressed caches the stored bytes instead, for a small disk.

Permissions: a prolog warms as root, the job reads as its user. Whatever the umask, files the
warm writes are 0644 and directories 0755, so every user can read the cache but only its owner
can change it; --mode 0640 --group hpcusers restricts reading to one group (directories get
search permission wherever the mode grants read). A job's user needs no write access: what the
cache lacks, its loader fetches into the user's own cache (SHARDTOOL_USER_CACHE, else
$TMPDIR/shardtool-cache-UID), with a warning.

exit codes:
  0  success; also a remote failure (source unreachable, timed out, shard missing or corrupt)
     without --strict: it is logged and the loader fetches on demand. Also 0 with --best-effort
     when not everything fit (warnings printed).
  1  remote failure with --strict
  2  usage error: bad arguments, node layout cannot be resolved, or no dataset at URL (the storage
     answers that its index.json does not exist, or the protocol is unknown)
  3  local fault on this node: cache dir missing/unwritable/read-only, disk full, or the cache
     budget too small for this node's shards (a prolog exiting non-zero drains the node)

in-job staging (no prolog): with --follow the warm runs beside the training job, on each node, and
fetches the node's shards in the order its ranks will first read them (published by ShardedLoader(...,
stage="external") in CACHE_DIR/stage/), at most --ahead shards ahead of the slowest rank. Give it the
job's --ranks-per-node. With --max-bytes/--min-free it stages only what fits in that budget and
evicts nothing (the ranks are reading); a shard over it is named once and left to the readers'
fetch-on-miss. It exits once every rank published its order and those shards are in (or over the
budget), or once every rank closed its loader.

examples:
  shardtool warm s3://bucket/ds --cache-dir /local/cache --nodes 4 --node-rank 1 --ranks-per-node 8
  shardtool warm ./ds --cache-dir /local/cache --nodes 2 --node-rank 0 --mesh pp=2,dp=2   # PP across nodes
""".format(layout=LAYOUT_HELP)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "url",
        help="dataset root: local path, file://, s3://, gs://, http(s)://; or a mixture file "
        "(.json/.yaml) to warm every source it names",
    )
    p.add_argument("--cache-dir", required=True, help="node-local cache directory")
    g = p.add_argument_group("node layout")
    g.add_argument("--nodes", type=int, help="number of nodes (default: SLURM_JOB_NUM_NODES, else 1)")
    g.add_argument("--node-rank", type=int, help="this node's index in [0, nodes) (default: SLURM_NODEID)")
    g.add_argument(
        "--ranks-per-node",
        type=int,
        help="ranks per node (with pure data parallelism only recorded: it does not change the node's "
        "shards; with --dp-size or --mesh it places the model-parallel peers)",
    )
    g.add_argument("--all", action="store_true", help="warm every shard of the dataset")
    add_layout_arguments(p.add_argument_group("data layout (as given to ShardedLoader)"))
    p.add_argument("--jobs", "-j", type=int, default=8, help="concurrent transfers (default 8)")
    b = p.add_argument_group("budget")
    b.add_argument(
        "--max-bytes",
        type=size_arg,
        help="most bytes of shards the cache may hold (e.g. 800G, 750GiB); each dataset's metadata "
        "(manifest, lengths, summaries, sample indexes: a few percent of its shards) comes on top",
    )
    b.add_argument("--min-free", type=size_arg, help="bytes to leave free on the cache's disk (e.g. 20G)")
    b.add_argument(
        "--best-effort", action="store_true", help="if this node's shards do not fit, warm what fits and warn (exit 0)"
    )
    f = p.add_argument_group("failures")
    f.add_argument("--strict", action="store_true", help="exit 1 on remote failures (default: log them, exit 0)")
    f.add_argument("--timeout", type=float, help="overall deadline in seconds")
    f.add_argument("--retries", type=int, default=5, help="attempts per object on transient errors (default 5)")
    f.add_argument("--attempt-timeout", type=float, default=900.0, help="seconds for one try of one object")
    f.add_argument("--stall-timeout", type=float, default=60.0, help="seconds a single read may stall")
    p.add_argument(
        "--durable",
        action="store_true",
        help="fsync every shard before publishing it, so the cache survives a machine crash without "
        "re-hashing (slower: waits for the disk, like `cp; sync`). Without it, shards are published "
        "as soon as verified, like `cp`, and any not yet on disk when the machine crashes are "
        "hashed again before they are trusted",
    )
    p.add_argument(
        "--verify", action="store_true", help="re-hash shards already in the cache instead of trusting stamps"
    )
    p.add_argument(
        "--keep-compressed",
        action="store_true",
        help="cache a compressed dataset's shards as stored (smaller; every read then decompresses a "
        "record batch). Default: decompress each into a plain, memory-mappable shard on its way in",
    )
    a = p.add_argument_group("permissions")
    a.add_argument(
        "--mode",
        default="0644",
        help="octal mode of the files the warm writes (default 0644: readable by every user, whatever "
        "the umask); directories get x wherever it grants r (0644 -> 0755, 0640 -> 0750)",
    )
    a.add_argument(
        "--group",
        help="group (name or gid) of the files and directories the warm writes, e.g. with "
        "--mode 0640 to let only that group's jobs read the cache",
    )
    add_storage_option_argument(p)
    p.add_argument(
        "--report", metavar="FILE", help="write a JSON report (shards/bytes copied/skipped/failed, seconds, GB/s)"
    )
    p.add_argument("--json", action="store_true", help="print the JSON report on stdout")
    s = p.add_argument_group("in-job staging")
    s.add_argument(
        "--follow",
        action="store_true",
        help="stage beside the job: fetch the shards its ranks publish, in their order, ahead of them",
    )
    s.add_argument("--ahead", type=int, default=16, help="shards staged ahead of the slowest rank (default 16)")
    s.add_argument("--ahead-bytes", type=size_arg, help="and at most this many bytes ahead (e.g. 20G)")
    s.add_argument("--bandwidth", type=size_arg, help="bytes per second over all transfers (e.g. 500M)")
    s.add_argument(
        "--run",
        help="the job's id shared with its ranks (default: SHARDTOOL_STAGE_RUN, SLURM_JOB_ID, TORCHELASTIC_RUN_ID)",
    )
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")


def perms_from(args):
    """The cache's permissions from --mode/--group; ValueError naming the option when bad."""
    from ..cache.perms import Perms, parse_group, parse_mode

    try:
        mode = parse_mode(args.mode)
    except ValueError as e:
        raise ValueError(f"--mode: {e}") from None
    try:
        gid = None if args.group is None else parse_group(args.group)
    except ValueError as e:
        raise ValueError(f"--group: {e}") from None
    if gid is not None and os.geteuid() != 0 and gid not in (os.getegid(), *os.getgroups()):
        raise ValueError(f"--group {args.group}: only root or a member of the group can give files to it")
    return Perms(mode, gid)


def mesh_placement(args, placement):
    """``placement`` with ranks per node from --mesh where nothing else gave more than one."""
    from ..plan import Layout, LayoutError, Placement

    mesh, layout = parsed_mesh(args), placement.layout
    if (
        mesh is None
        or args.ranks_per_node is not None
        or layout.ranks_per_node != 1
        or mesh.ranks.size == layout.world_size
    ):
        return placement
    if mesh.ranks.size % layout.num_nodes:
        raise LayoutError(
            f"the mesh {mesh.describe()} has {mesh.ranks.size} ranks, which do not divide over "
            f"{layout.num_nodes} node(s); give --nodes and --ranks-per-node of the job"
        )
    return Placement(
        Layout(layout.num_nodes, mesh.ranks.size // layout.num_nodes),
        placement.node,
        source=f"{placement.source}; ranks per node from --mesh",
    )


def run(args) -> int:
    from ..cache import RetryPolicy, warm
    from ..cache.errors import EXIT_USAGE
    from ..plan import LayoutError, Placement, node_placement
    from ..plan.mixture import is_mixture_file

    if args.jobs < 1 or args.retries < 1:
        print("shardtool warm: error: --jobs and --retries must be >= 1", file=sys.stderr)
        return EXIT_USAGE
    if args.follow:
        return follow(args)
    try:
        perms = perms_from(args)
    except ValueError as e:
        print(f"shardtool warm: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    placement: Placement | None = None
    data = None
    described = args.mesh or args.dp_size is not None or args.nodes_per_group != 1
    if args.all and described:
        print(
            "shardtool warm: error: --all warms every shard; --mesh, --dp-size and --nodes-per-group do not apply",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if not args.all:
        try:
            placement = node_placement(args.nodes, args.node_rank, args.ranks_per_node, env=os.environ)
            if described:
                placement = mesh_placement(args, placement)
                try:
                    data, _ = data_layout_of(args, placement)
                except LayoutError as e:
                    raise LayoutError(
                        f"{e} ({placement.describe()}; --nodes and --ranks-per-node must be the training job's)"
                    ) from None
        except LayoutError as e:
            print(f"shardtool warm: error: {e}", file=sys.stderr)
            return EXIT_USAGE
    policy = RetryPolicy(attempts=args.retries, attempt_timeout=args.attempt_timeout, stall_timeout=args.stall_timeout)
    warm_url: Callable[..., WarmReport | MixtureWarmReport] = warm
    if is_mixture_file(args.url):  # every source of the mixture, one report
        from ..cache.mixwarm import warm_mixture

        warm_url = warm_mixture
    said: set[str] = set()  # said while warming (its log): not said again among the warnings

    def log(msg: str) -> None:
        said.add(msg)
        print(f"shardtool warm: {msg}", file=sys.stderr)

    report = warm_url(
        args.url,
        args.cache_dir,
        log=log,
        placement=placement,
        data_layout=data,
        all_shards=args.all,
        jobs=args.jobs,
        max_bytes=args.max_bytes,
        min_free=args.min_free,
        best_effort=args.best_effort,
        strict=args.strict,
        timeout=args.timeout,
        verify=args.verify,
        durable=args.durable,
        retry=policy,
        storage_options=storage_options_from(args),
        perms=perms,
        keep_compressed=args.keep_compressed,
        progress=(not args.quiet) and sys.stderr.isatty(),
    )
    for r in getattr(report, "reports", {"": report}).values():  # a mixture: each source's report
        if r.data_layout is not None and (args.mesh or args.nodes_per_group != 1):
            r.data_layout.update(describe_layout(args))
    if args.report:
        from ..format.atomic import atomic_write_bytes

        try:
            atomic_write_bytes(args.report, report.to_json().encode())
        except OSError as e:  # the report must never turn a good warm into a failure
            print(f"shardtool warm: warning: cannot write report {args.report}: {e}", file=sys.stderr)
    for w in report.warnings:
        if w not in said:
            print(f"shardtool warm: warning: {w}", file=sys.stderr)
    if report.error:
        kind = {"local_fault": "local fault", "remote_failed": "remote failure", "usage_error": "error"}.get(
            report.status, report.status
        )
        tail = "" if report.exit_code else " (not fatal without --strict; the loader fetches on demand)"
        print(f"shardtool warm: {kind}: {report.error}{tail}", file=sys.stderr)
    print(report.summary(), file=sys.stderr)
    if args.json:
        print(report.to_json())
    return report.exit_code


def follow(args) -> int:
    """``--follow``: the node's stager for a job whose loaders publish (shardtool.cache.stager)."""
    from ..cache import NotCached, RetryPolicy, open_cache
    from ..cache.errors import EXIT_LOCAL, EXIT_USAGE
    from ..cache.stager import follow as stage
    from ..cache.stager import stage_run
    from ..plan import LayoutError, node_placement
    from ..plan.mixture import is_mixture_file

    try:
        rpn = node_placement(args.nodes, args.node_rank, args.ranks_per_node, env=os.environ).layout.ranks_per_node
    except LayoutError as e:
        print(f"shardtool warm: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.ahead < 1:
        print("shardtool warm: error: --ahead must be >= 1", file=sys.stderr)
        return EXIT_USAGE
    if is_mixture_file(args.url) or args.all:
        print(
            "shardtool warm: error: --follow stages one dataset for its ranks (not a mixture, not --all)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    policy = RetryPolicy(attempts=args.retries, attempt_timeout=args.attempt_timeout, stall_timeout=args.stall_timeout)
    try:
        cache = open_cache(
            args.url,
            args.cache_dir,
            storage_options=storage_options_from(args),
            retry=policy,
            max_bytes=args.max_bytes,  # the stager stages what fits in them, evicting nothing
            min_free=args.min_free,
        )
    except NotCached as e:  # the loaders will say the same, naming their rank: not this node's fault
        print(f"shardtool warm: error: {e}", file=sys.stderr)
        return 0
    report = stage(
        cache,
        run=args.run or stage_run(os.environ),
        ranks=rpn,
        ahead_shards=args.ahead,
        ahead_bytes=args.ahead_bytes,
        jobs=args.jobs,
        bandwidth=args.bandwidth,
    )
    print(f"shardtool warm --follow: {report.summary()}", file=sys.stderr)
    return EXIT_LOCAL if report.status == "local_fault" else 0
