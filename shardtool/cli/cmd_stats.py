"""`shardtool stats`: one table from the loader metric files of every node of a run."""

from __future__ import annotations

import json
import sys

from ..format.errors import ShardtoolError
from ..format.sizes import format_size

HELP = "merge the loader's per-rank metric files (JSONL) of every node into one table"
DESCRIPTION = """\
Each rank of a training job appends one JSON line every `metrics_every` steps to a node-local
file (ShardedLoader's metrics_dir; by default <cache_dir>/metrics/<run> or
$TMPDIR/shardtool-metrics/<run>). Copy or point at those directories of every node and this
merges them: per rank and per node the share of time spent waiting for data, tokens/s, cache
hit rate and bytes read by tier, and the slowest ranks (those waiting longest for data).

  shardtool stats /local/nvme/cache/metrics/slurm-1234            # one node
  shardtool stats node*/metrics --plot loader.png --json stats.json

With lines of several runs, the newest run is shown unless --run names another.
"""


def add_arguments(p) -> None:
    p.add_argument("paths", nargs="*", help="metric directories (searched recursively for *.jsonl) or files")
    p.add_argument("--run", default=None, help="the run id to show (default: the newest run found)")
    p.add_argument("--top", type=int, default=3, help="how many of the slowest ranks to name (default 3)")
    p.add_argument(
        "--json",
        dest="json_path",
        nargs="?",
        const="-",
        default=None,
        help="write the summary as JSON to this file; with no file, to stdout instead of the tables",
    )
    p.add_argument(
        "--plot",
        default=None,
        metavar="PNG",
        help="draw wait fraction and tokens/s per rank over steps (needs matplotlib: shardtool[plot])",
    )


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _num(x, spec=",.0f") -> str:
    return "-" if x is None else format(x, spec)


def _read(row) -> str:
    return " / ".join(format_size(row[f"bytes_read.{t}"]) for t in ("cache", "local", "remote"))


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    fmt = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return [fmt(header), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)]


def format_summary(run: str, s: dict) -> str:
    """The per-rank and per-node tables and the slowest ranks, as text."""
    ranks, nodes = s["ranks"], s["nodes"]
    steps = sorted({r["steps"] for r in ranks})
    lines = [
        f"run {run}: {len(ranks)} rank(s) on {len(nodes)} node(s), "
        f"{steps[0] if len(steps) == 1 else f'{steps[0]}-{steps[-1]}'} steps per rank",
        "",
        "per rank",
    ]
    lines += _table(
        [
            "rank",
            "node",
            "host",
            "steps",
            "wait %",
            "tokens/s",
            "samples/s",
            "cache hit",
            "read: cache / local / remote",
            "open p99",
        ],
        [
            [
                str(r["rank"]),
                str(r["node"]),
                str(r["host"]),
                str(r["steps"]),
                _pct(r["wait_fraction"]),
                _num(r["tokens_per_s"]),
                _num(r["samples_per_s"]),
                _pct(r["cache_hit_rate"]),
                _read(r),
                "-" if r["shard_open_p99_s"] is None else f"{1000 * r['shard_open_p99_s']:.1f} ms",
            ]
            for r in ranks
        ],
    )
    lines += ["", "per node"]
    lines += _table(
        ["node", "hosts", "ranks", "wait %", "tokens/s", "cache hit", "read: cache / local / remote"],
        [
            [
                str(n["node"]),
                ",".join(n["hosts"]),
                str(n["ranks"]),
                _pct(n["wait_fraction"]),
                _num(n["tokens_per_s"]),
                _pct(n["cache_hit_rate"]),
                _read(n),
            ]
            for n in nodes
        ],
    )
    for key, what in (("plan_cost", "batch costs (cost model)"), ("step_time", "step times the trainer reported")):
        b = s.get("balance", {}).get(key)
        if b:
            lines += [
                "",
                f"steps waiting for the slowest DP rank, from {what}: {b['steps']:,} steps of {b['dp_ranks']} ranks, "
                f"max/mean median {b['max_over_mean_median']:.3f}, p90 {b['max_over_mean_p90']:.3f}, "
                f"max {b['max_over_mean_max']:.3f}; step time lost {b['time_lost']:.2%} "
                f"(the least any order of these steps could lose: {b.get('time_lost_floor', 0.0):.2%})",
            ]
    lines += ["", "slowest ranks (largest share of time waiting for data)"]
    lines += [
        f"  rank {r['rank']} (node {r['node']}, {r['host']}): wait {_pct(r['wait_fraction'])}, "
        f"tokens/s {_num(r['tokens_per_s'])}"
        for r in s["slowest"]
    ]
    return "\n".join(lines)


def run(args) -> int:
    import os

    from ..loader.observability import stats

    if not args.paths and args.json_path not in (None, "-") and os.path.isdir(args.json_path):
        # `stats --json DIR`: --json takes an optional file, so it took the directory; a directory
        # is never the JSON file to write, so it is what the user meant to read.
        args.paths, args.json_path = [args.json_path], "-"
    if not args.paths:
        raise ShardtoolError("give the metric directories or files to read (shardtool stats DIR [--json [FILE]])")
    try:
        files = stats.metric_files(args.paths)
        lines, bad = stats.read_lines(files)
        if not lines:
            raise stats.StatsError(f"no loader metric lines in {', '.join(args.paths)} ({len(files)} *.jsonl files)")
        by_run = stats.runs(lines)
        run_id = args.run if args.run is not None else list(by_run)[-1]
        if run_id not in by_run:
            raise stats.StatsError(f"run {run_id!r} is not in these files; runs found: {', '.join(by_run)}")
        summary = stats.summarize(by_run[run_id], top=args.top)
        summary["balance"] = stats.step_balance_of(by_run[run_id])
        if args.plot:
            stats.plot(run_id, by_run[run_id], args.plot, highlight=[r["rank"] for r in summary["slowest"]])
    except stats.StatsError as e:
        print(f"shardtool stats: {e}", file=sys.stderr)
        return 2
    others = [r for r in by_run if r != run_id]
    if args.json_path:
        text = json.dumps(
            {"run": run_id, "other_runs": others, "files": len(files), "unreadable_lines": bad, **summary}, indent=1
        )
        if args.json_path != "-":
            with open(args.json_path, "w") as f:
                f.write(text + "\n")
    print(text if args.json_path == "-" else format_summary(run_id, summary), flush=True)
    if others:
        print(f"({len(others)} other run(s) in these files: {', '.join(others)}; pick one with --run)", file=sys.stderr)
    if bad:
        print(f"({bad} unreadable line(s) skipped)", file=sys.stderr)
    if args.plot:
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0
