"""Planning at scale: what one training rank pays at start-up, against the dataset's size.

Side by side in one run, for N = 10^7, 10^8 and 10^9 synthetic samples (lognormal lengths,
median 350, 10^4 samples per shard) on 1,024 nodes x 8 ranks and on 8 x 8, with a token budget
of 65,536 per batch: the per-rank planning time and peak RSS of one training rank, each measured
by ``shardtool plan --synthetic N --simulate-nodes NODES --ranks-per-node 8 --rank R --json`` —
a fresh process that reads the per-shard summaries and plans its own data group, as a rank does
at start-up. Then the full simulation of every group of 10^8 samples on 1,024 x 8 (``shardtool
plan`` without ``--rank``). Every run is its own subprocess, so peaks never mix.

Targets (issue 12), printed met / MISSED:
  - per-rank plan <= 2 s and <= 300 MB peak RSS at 10^9 samples on 1,024 x 8
  - trace one step of a rank (its plan, then the step's samples located in their shards) <= 2 s
    at 10^9 on 1,024 x 8 (issue 35; the keys are then one read of each shard index it touches)
  - per-rank time at 10^9 <= 2 x that at 10^7 (it grows with the share, not the dataset)
  - the full simulation of 10^8 on 1,024 x 8 <= 10 s
  - bytes per node max / mean <= 1.05 (at 10^9 on 1,024 x 8: ~100 shards per node; at fewer
    shards than nodes, a node caches whole shards it reads a part of)

On 8 x 8 a group holds 1/8 of the dataset, so its rank's cost is that share's: the column shows
the cost following the share, not a target. Needs a quiet machine (the lead runs it); at 10^9 on
8 x 8 a rank plans 1.25 x 10^8 samples (several GB).

    python -m benchmarks.plan_scale            # the full table (minutes)
    python -m benchmarks.plan_scale --quick    # 10^6 and 10^7 only: a smoke run (targets at 10^7)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_TOKENS = 65536
RANKS_PER_NODE = 8
PER_SHARD = 10_000
TARGETS = {
    "rank_seconds": 2.0,
    "trace_seconds": 2.0,
    "rank_rss_mb": 300.0,
    "growth": 2.0,
    "simulation_seconds": 10.0,
    "bytes_balance": 1.05,
}


def plan(n: int, nodes: int, rank: int | None, timeout: float) -> dict:
    """One ``shardtool plan --json`` run in a subprocess: its report, plus the command."""
    cmd = [
        sys.executable,
        "-m",
        "shardtool",
        "plan",
        "--synthetic",
        str(n),
        "--samples-per-shard",
        str(PER_SHARD),
        "--simulate-nodes",
        str(nodes),
        "--ranks-per-node",
        str(RANKS_PER_NODE),
        "--max-tokens",
        str(MAX_TOKENS),
        "--json",
    ]
    if rank is not None:
        cmd += ["--rank", str(rank)]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    shown = " ".join(["shardtool", *cmd[3:]])
    if res.returncode != 0:
        raise SystemExit(f"{shown} failed ({res.returncode}):\n{res.stderr[-2000:]}")
    return {**json.loads(res.stdout), "command": shown}


def middle_rank(nodes: int) -> int:
    """A rank in the middle of the job, not on its first node (rank 4,100 of 8,192)."""
    return nodes * RANKS_PER_NODE // 2 + 4


def power(n: int) -> str:
    """10**9 -> "10^9"."""
    return f"10^{len(str(n)) - 1}" if str(n).strip("0") == "1" else f"{n:,}"


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="N = 10^6 and 10^7 only, simulation of 10^7 (smoke run)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per subprocess (default 1800)")
    p.add_argument("--json", metavar="FILE", help="also write every run's report to FILE")
    args = p.parse_args(argv)

    sizes = [10**6, 10**7] if args.quick else [10**7, 10**8, 10**9]
    simulated = 10**7 if args.quick else 10**8
    big = sizes[-1]
    layouts = [1024, 8]
    rows = []
    print(
        f"per-rank planning: one training rank's start-up, in a fresh process (max_tokens {MAX_TOKENS:,}, "
        f"{PER_SHARD:,} samples per shard)"
    )
    header = (
        f"{'samples':>15} {'layout':>8} {'rank':>6} {'group':>13} {'plan s':>8} {'peak RSS MB':>12} "
        f"{'batches/rank':>13} {'remainder':>10} {'bytes/node max/mean':>20}"
    )
    print(header)
    for n in sizes:
        for nodes in layouts:
            r = plan(n, nodes, middle_rank(nodes), args.timeout)
            rows.append(r)
            print(
                f"{n:>15,} {f'{nodes}x{RANKS_PER_NODE}':>8} {r['rank']:>6} {r['group_samples']:>13,} "
                f"{r['plan_seconds']:>8.3f} {r['peak_rss_mb']:>12.0f} {r['batches_per_rank']:>13,} "
                f"{r['remainder_tokens_fraction']:>10.3%} {r['bytes_per_node_max_over_mean']:>20.3f}",
                flush=True,
            )
    sim = plan(simulated, 1024, None, args.timeout)
    print(
        f"\nfull simulation of every group: {simulated:,} samples on 1024x{RANKS_PER_NODE}: "
        f"{sim['plan_seconds']:.2f} s, peak RSS {sim['peak_rss_mb']:.0f} MB, remainder "
        f"{sim['remainder_tokens_fraction']:.3%} of the tokens, samples/rank "
        f"{sim['samples_per_rank']['min']:,}..{sim['samples_per_rank']['max']:,} "
        f"(summaries made up in {sim['synthetic_seconds']:.1f} s, not counted)"
    )
    print(f"  {sim['command']}")

    def at(n: int, nodes: int) -> dict:
        return next(r for r in rows if r["samples"] == n and r["layout"]["nodes"] == nodes)

    small, large = at(sizes[0], 1024), at(big, 1024)
    label = power(big)
    checks = [
        (
            f"per-rank plan at {label} on 1024x8 <= {TARGETS['rank_seconds']:g} s",
            f"{large['plan_seconds']:.3f} s",
            large["plan_seconds"] <= TARGETS["rank_seconds"],
        ),
        (
            f"trace one step of a rank at {label} on 1024x8 <= {TARGETS['trace_seconds']:g} s",
            f"{large['trace_step_seconds']:.3f} s",
            large["trace_step_seconds"] <= TARGETS["trace_seconds"],
        ),
        (
            f"per-rank peak RSS at {label} on 1024x8 <= {TARGETS['rank_rss_mb']:g} MB",
            f"{large['peak_rss_mb']:.0f} MB",
            large["peak_rss_mb"] <= TARGETS["rank_rss_mb"],
        ),
        (
            f"per-rank time at {label} <= {TARGETS['growth']:g}x that at {power(sizes[0])} (1024x8)",
            f"{large['plan_seconds'] / small['plan_seconds']:.2f}x",
            large["plan_seconds"] <= TARGETS["growth"] * small["plan_seconds"],
        ),
        (
            f"full simulation of {power(simulated)} on 1024x8 <= {TARGETS['simulation_seconds']:g} s",
            f"{sim['plan_seconds']:.2f} s",
            sim["plan_seconds"] <= TARGETS["simulation_seconds"],
        ),
        (
            f"bytes per node max/mean at {label} on 1024x8 <= {TARGETS['bytes_balance']:g}",
            f"{large['bytes_per_node_max_over_mean']:.3f}",
            large["bytes_per_node_max_over_mean"] <= TARGETS["bytes_balance"],
        ),
    ]
    print("\ntargets" + (" (--quick: checked at the sizes of this run, not the issue's)" if args.quick else ""))
    for name, value, ok in checks:
        print(f"  {name:<58} {value:>10}  {verdict(ok)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "ranks": rows,
                    "simulation": sim,
                    "targets": [{"target": n, "value": v, "met": ok} for n, v, ok in checks],
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
