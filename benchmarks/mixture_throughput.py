"""A 3-source mixture against the same samples as one dataset, in the same run; a mixture's plan time.

Throughput: the lognormal token corpus (median ~350, int32 tokens) written as three datasets of
50/30/20% of ``--n`` samples, and once more as one dataset holding the same samples. ShardedLoader
reads the mixture (weights proportional to each source's tokens, so that, like one epoch of the
single dataset, it reads every sample about once) and the single dataset with the same batching
— packed rows (``--seq-len`` x ``--rows``) and bucketed ``--max-tokens`` — for the single
dataset's batches of one epoch, with num_workers 0 and 2. Each measurement runs in its own
process; after a warm-up of both, ``--repeats`` rounds alternate which goes first; the table
gives medians of real tokens/s and the median of the per-round ratios with its range.
Target: mixture >= 0.9x single.

Plan time: what one training rank computes at start-up for a 3-source mixture of ``--plan-n``
samples in all (50/30/20%, synthetic lognormal lengths; the per-shard summaries made beforehand,
as a dataset stores them), on 1,024 x 8 and 8 x 8 ranks: the mixture planner (every source's
shape from its summaries), the composition, and the rank's plan of its first units of every
source, in a fresh process, with its peak RSS. Target on 1,024 x 8: <= 2 s (the per-rank target
of plan v2); on 8 x 8 a rank plans an eighth of every source, so its time grows with the share.

    python -m benchmarks.mixture_throughput [--n 200000] [--repeats 3] [--max-seconds 20] \\
        [--plan-n 100000000] [--skip-plan | --skip-throughput] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SHARES = {"web": 0.5, "code": 0.3, "math": 0.2}
PER_SHARD = 10_000


# ---------------------------------------------------------------------- corpora
def write_corpora(base: str, n: int) -> dict[str, str]:
    """Three sources and one dataset of the same samples (same lengths, so the same bytes read)."""
    from shardtool.pack.synthetic import write_synthetic
    from shardtool.plan.synthetic import lognormal_lengths

    roots = {name: os.path.join(base, name) for name in [*SHARES, "single"]}
    parts = {name: lognormal_lengths(int(n * share), seed=i) for i, (name, share) in enumerate(SHARES.items())}
    for name, lengths in [*parts.items(), ("single", np.concatenate(list(parts.values())))]:
        if not os.path.exists(os.path.join(roots[name], "index.json")):
            write_synthetic(
                roots[name],
                len(lengths),
                lengths=lengths,
                samples_per_shard=PER_SHARD,
                vocab=50_000,
                key_prefix=name[0],
                key_width=9,
                shard_name="tok-{:05d}",
            )
    return roots


def batching(args) -> list[tuple[str, dict]]:
    return [
        ("packed", {"seq_len": args.seq_len, "batch_size": args.rows, "packing": "best-fit", "eos_id": 0}),
        ("bucketed", {"max_tokens": args.max_tokens}),
    ]


# ---------------------------------------------------------------------- one measurement (own process)
def run_one(args) -> dict:
    from shardtool.format import open_dataset
    from shardtool.loader import Mixture, ShardedLoader

    kw = json.loads(args.kw)
    began = time.perf_counter()
    if args.one == "single":
        loader = ShardedLoader(args.roots["single"], num_workers=args.workers, pin_memory=False, **kw)
    else:
        tokens = {n: int(open_dataset(args.roots[n]).summaries.tokens.sum()) for n in SHARES}
        mix = Mixture({n: (args.roots[n], t) for n, t in tokens.items()}, max_repeat=100)
        loader = ShardedLoader(mix, steps=args.steps, num_workers=args.workers, pin_memory=False, **kw)
    tokens = steps = 0
    first = None
    for batch in loader:
        if first is None:
            first = time.perf_counter() - began
            steady = time.perf_counter()
            continue  # start-up is reported apart from the steady rate
        tokens += int(batch["lengths"].sum())
        steps += 1
        if time.perf_counter() - steady > args.max_seconds:
            break
    seconds = time.perf_counter() - steady
    return {"first_batch_s": first, "steps": steps, "seconds": seconds, "tokens_per_s": tokens / seconds}


def measure(which: str, roots: dict, kw: dict, workers: int, steps: int, max_s: float) -> dict:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--one",
        which,
        "--roots",
        json.dumps(roots),
        "--kw",
        json.dumps(kw),
        "--workers",
        str(workers),
        "--steps",
        str(steps),
        "--max-seconds",
        str(max_s),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=1800)
    if res.returncode:
        raise SystemExit(f"{which} {kw} w={workers} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def paired(roots: dict, kw: dict, workers: int, repeats: int, max_s: float) -> dict:
    from shardtool.loader import ShardedLoader

    steps = len(ShardedLoader(roots["single"], num_workers=0, **kw))  # one epoch of the single dataset
    for which in ("mixture", "single"):
        measure(which, roots, kw, workers, steps, max_s)  # page cache and imports warm for both alike
    runs: dict[str, list] = {"mixture": [], "single": []}
    ratios = []
    for r in range(repeats):
        for which in ("mixture", "single") if r % 2 == 0 else ("single", "mixture"):
            runs[which].append(measure(which, roots, kw, workers, steps, max_s)["tokens_per_s"])
        ratios.append(runs["mixture"][-1] / runs["single"][-1])
    return {
        "steps": steps,
        "mixture_tokens_per_s": statistics.median(runs["mixture"]),
        "single_tokens_per_s": statistics.median(runs["single"]),
        "ratio": statistics.median(ratios),
        "ratio_range": [min(ratios), max(ratios)],
    }


# ---------------------------------------------------------------------- plan time (own process)
def write_summaries(base: str, n: int, processes: int) -> dict[str, str]:
    from shardtool.plan.synthetic import SyntheticSource

    out = {}
    for i, (name, share) in enumerate(SHARES.items()):
        path = os.path.join(base, f"summaries-{n}-{name}.arrow")
        if not os.path.exists(path):
            source = SyntheticSource(int(n * share), samples_per_shard=PER_SHARD, seed=i, processes=processes)
            with open(path, "wb") as f:
                f.write(source.summaries.to_bytes("synthetic"))
        out[name] = path
    return out


def plan_one(args) -> dict:
    """What training rank ``args.rank`` of the layout computes at start-up, timed here."""
    from shardtool.cli.cmd_plan import peak_rss_mb
    from shardtool.format.summaries import ShardSummaries
    from shardtool.plan import Batching, DataLayout, Layout
    from shardtool.plan.mixture import Mixture
    from shardtool.plan.mixture.planner import MixturePlanner
    from shardtool.plan.packing import Packing
    from shardtool.plan.synthetic import SyntheticSource

    paths = json.loads(args.summaries)
    began = time.perf_counter()
    sources = {}
    for i, (name, share) in enumerate(SHARES.items()):
        source = SyntheticSource(int(args.plan_n * share), samples_per_shard=PER_SHARD, seed=i)
        with open(paths[name], "rb") as f:
            source.use_summaries(
                ShardSummaries.from_bytes(
                    f.read(), lengths_hash=None, counts=source.shard_counts, total_tokens=None, source=paths[name]
                )
            )
        sources[name] = source
    nodes, per_node = (int(x) for x in args.layout.split("x"))
    layout = DataLayout.pure_dp(Layout(nodes, per_node))
    dp_rank = args.rank
    b = (
        Batching(batch_size=args.rows, packing=Packing(args.seq_len, eos_id=0))
        if args.kind == "packed"
        else Batching(max_tokens=args.max_tokens)
    )
    mixture = Mixture({n: (f"synthetic:{n}", s) for n, s in SHARES.items()})
    planner = MixturePlanner(mixture, sources, {n: n for n in SHARES}, b, layout)
    state = planner.start()
    planner.step_pieces(state, 0)
    units = {n: planner.rank_plan(state, n, 0, dp_rank).batches_per_rank for n in SHARES}
    return {
        "layout": args.layout,
        "kind": args.kind,
        "plan_seconds": time.perf_counter() - began,
        "peak_rss_mb": peak_rss_mb(),
        "units_per_rank": units,
    }


def plan_times(base: str, n: int, args) -> list[dict]:
    paths = write_summaries(base, n, processes=2)
    out = []
    for layout in ("1024x8", "8x8"):
        for kind in ("packed", "bucketed"):
            nodes, per_node = (int(x) for x in layout.split("x"))
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "--one",
                "plan",
                "--summaries",
                json.dumps(paths),
                "--layout",
                layout,
                "--kind",
                kind,
                "--plan-n",
                str(n),
                "--rank",
                str(nodes * per_node // 2 + 1),
                "--seq-len",
                str(args.seq_len),
                "--rows",
                str(args.rows),
                "--max-tokens",
                str(args.max_tokens),
            ]
            res = subprocess.run(
                cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=3600
            )
            if res.returncode:
                raise SystemExit(f"plan {layout} {kind} failed:\n{res.stderr[-3000:]}")
            out.append(json.loads(res.stdout.strip().splitlines()[-1]))
    return out


# ---------------------------------------------------------------------- report
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=200_000, help="token samples in all (default 200,000)")
    p.add_argument("--dir", default=None, help="where to write the corpora (default: a temp dir)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-seconds", type=float, default=20.0, help="stop a steady-state measurement after this long")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--rows", type=int, default=8, help="packed rows per batch (default 8)")
    p.add_argument("--max-tokens", type=int, default=65536)
    p.add_argument("--plan-n", type=int, default=100_000_000, help="samples of the planned mixture (default 10^8)")
    p.add_argument("--skip-plan", action="store_true")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--json", action="store_true")
    for hidden in ("--one", "--roots", "--kw", "--summaries", "--layout", "--kind"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    p.add_argument("--workers", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one == "plan":
        print(json.dumps(plan_one(args)))
        return
    if args.one:
        args.roots = json.loads(args.roots)
        print(json.dumps(run_one(args)))
        return
    base = args.dir or tempfile.mkdtemp(prefix="mixture-bench-")
    results: dict = {"n": args.n, "plan_n": args.plan_n}
    if not args.skip_throughput:
        t = time.perf_counter()
        roots = write_corpora(base, args.n)
        print(
            f"corpora in {base} ({time.perf_counter() - t:.1f} s): {args.n:,} samples as 3 sources and as one",
            file=sys.stderr,
        )
        results["throughput"] = {
            f"{kind}/w{w}": paired(roots, kw, w, args.repeats, args.max_seconds)
            for kind, kw in batching(args)
            for w in (0, 2)
        }
    if not args.skip_plan:
        results["plan"] = plan_times(base, args.plan_n, args)
    if args.json:
        print(json.dumps(results, indent=1))
        return
    for name, r in results.get("throughput", {}).items():
        lo, hi = r["ratio_range"]
        print(
            f"{name:<14} mixture {r['mixture_tokens_per_s']:>12,.0f} tok/s  single {r['single_tokens_per_s']:>12,.0f} "
            f"tok/s  ratio {r['ratio']:.3f} [{lo:.3f}-{hi:.3f}] (target >= 0.9: {'met' if r['ratio'] >= 0.9 else 'MISSED'})"
        )
    for r in results.get("plan", []):
        # The target is plan v2's, per rank of a large layout; on 8 x 8 a rank plans 1/8 of every source.
        goal = (
            f"target <= 2 s: {'met' if r['plan_seconds'] <= 2 else 'MISSED'}"
            if r["layout"] == "1024x8"
            else "grows with the share"
        )
        print(
            f"plan {r['layout']:<7} {r['kind']:<9} {r['plan_seconds']:.3f} s, peak RSS {r['peak_rss_mb']:.0f} MB "
            f"(3 sources, {args.plan_n:,} samples; {goal})"
        )


if __name__ == "__main__":
    main()
