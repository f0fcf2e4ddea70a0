"""`shardtool bench`: loader throughput per node, side by side with peers, in one run."""

from __future__ import annotations

import argparse
import sys
import tempfile

HELP = "benchmark loader throughput per node (G ranks × workers) and data-wait fraction, vs peers"
DESCRIPTION = """\
Runs G loader ranks on this node as real processes (as torchrun would), each with its own
workers, consuming batches like a training loop with a simulated step time, and reports per
node: samples/s, tokens/s, MB/s, time to first batch, padding efficiency, peak RSS, and the
data-wait fraction (share of steady-state time spent waiting for the next batch). For shardtool
these come from the loader's own metrics (loader.metrics(), the window after the first batch),
with bytes read from storage (read_mb_per_s), cache hit rate and shard-open p99; the JSON
carries each rank's full metrics under "loader_per_rank". Peers are timed by the harness.

  shardtool bench DATASET --ranks 2 --workers 0,2 --compare webdataset
  shardtool bench --generate 20000 --json out.json --plot out.png

Each run (one reader at one --workers value) stops after --max-batches batches per rank, by
default after about 20 s of simulated steps (--seconds), and the bench prints an estimate of its
whole duration before the first run.

--compare reads the same tar shards through each peer's recommended set-up in the same run
and prints the ratio shardtool / peer.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", nargs="?", help="dataset URL (tar format for --compare webdataset)")
    p.add_argument(
        "--generate",
        type=int,
        metavar="N",
        default=None,
        help="build a synthetic token corpus of N samples in a temp dir and bench that",
    )
    p.add_argument("--ranks", type=int, default=2, help="loader ranks on this node (default 2)")
    p.add_argument("--workers", default="0,2", help="comma-separated num_workers values to try (default 0,2)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--batch-size", type=int, default=None, help="samples per batch (instead of a token budget)")
    g.add_argument("--max-tokens", type=int, default=None, help="token budget per batch (default 16384)")
    p.add_argument(
        "--step-ms",
        type=float,
        default=None,
        help="simulated training step per batch; default: a measured tiny-model step on this machine",
    )
    p.add_argument(
        "--max-batches",
        type=int,
        default=None,
        help="stop each rank after this many batches (default: about --seconds of simulated steps; "
        "with --step-ms 0, one epoch)",
    )
    p.add_argument(
        "--seconds",
        type=float,
        default=None,
        metavar="S",
        help="without --max-batches, each run stops after about S seconds of simulated steps "
        "(default 20); the bench prints how long it will take before starting",
    )
    p.add_argument("--compare", default="", help="comma-separated peers: webdataset")
    p.add_argument("--json", dest="json_path", default=None, help="write all results as JSON here")
    p.add_argument("--plot", default=None, help="write a PNG plot (throughput and wait vs workers)")
    p.add_argument(
        "--timeout",
        type=float,
        default=900.0,
        help="seconds one run (one reader at one --workers value) may take; a rank still running "
        "then is killed with its workers, named on stderr, and the bench exits 1 (default 900)",
    )


def run(args) -> int:
    from ..benchmarks import node as bench
    from ..format import open_dataset

    tmp = None
    url = args.url
    if args.generate:
        tmp = tempfile.TemporaryDirectory(prefix="shardtool-bench-")
        url = bench.generate_token_dataset(tmp.name, args.generate)
        print(f"generated {args.generate} samples in {url}", file=sys.stderr)
    if not url:
        print("shardtool bench: give a dataset URL or --generate N", file=sys.stderr)
        return 2
    ds = open_dataset(url)
    max_tokens = args.max_tokens if args.batch_size is None else None
    if args.batch_size is None and max_tokens is None:
        max_tokens = 16384
    step_ms = args.step_ms
    if step_ms is None:
        step_ms = bench.measure_step_ms(batch_tokens=max_tokens or 4096)
        print(f"simulated step: {step_ms:.1f} ms (measured tiny-model step)", file=sys.stderr)
    peers = [p for p in args.compare.split(",") if p]
    for peer in peers:
        if peer not in bench.READERS:
            print(
                f"shardtool bench: unknown peer {peer!r} (known: {sorted(set(bench.READERS) - {'shardtool'})})",
                file=sys.stderr,
            )
            return 2
    if peers and ds.manifest.shard_format != "tar":
        print("shardtool bench: --compare needs a tar-format dataset (peers read the same shards)", file=sys.stderr)
        return 2
    wds_urls = [ds.shard_path(i) for i in range(ds.num_shards)] if ds.manifest.shard_format == "tar" else []
    length_field = ds.manifest.length.get("field")
    length_ext = ds.manifest.field(length_field).ext if length_field else None
    if peers and not length_field:
        print("shardtool bench: --compare needs a dataset with a length (token) field", file=sys.stderr)
        return 2
    max_batches = args.max_batches
    if max_batches is None:
        max_batches = bench.default_max_batches(
            step_ms, args.seconds if args.seconds is not None else bench.DEFAULT_RUN_S
        )
    worker_counts = [int(w) for w in args.workers.split(",") if w != ""]
    print(_estimate(bench, ds, args, worker_counts, peers, max_tokens, step_ms, max_batches), file=sys.stderr)
    rows = []
    for workers in worker_counts:
        for name in ["shardtool", *peers]:
            cfg = bench.BenchConfig(
                url=url,
                ranks=args.ranks,
                num_workers=workers,
                batch_size=args.batch_size,
                max_tokens=max_tokens,
                step_ms=step_ms,
                max_batches=max_batches,
                webdataset_urls=wds_urls,
                length_field=length_field,
                length_ext=length_ext,
            )
            row = bench.summarize(bench.run_node(name, cfg, timeout=args.timeout))
            row["step_ms"], row["max_batches"] = step_ms, max_batches
            rows.append(row)
            for error in row["errors"]:
                print(f"shardtool bench: {name} (workers={workers}) failed: {error}", file=sys.stderr)
    print(bench.format_table(rows))
    ratios = []
    for peer in peers:
        for mine in (r for r in rows if r["reader"] == "shardtool"):
            theirs = next((r for r in rows if r["reader"] == peer and r["num_workers"] == mine["num_workers"]), None)
            if theirs and theirs["samples_per_s"]:
                ratio = mine["samples_per_s"] / theirs["samples_per_s"]
                ratios.append({"peer": peer, "num_workers": mine["num_workers"], "samples_per_s_ratio": ratio})
                print(f"shardtool / {peer} samples/s at num_workers={mine['num_workers']}: {ratio:.1f}x")
    if args.json_path:
        bench.write_json(args.json_path, {"url": url, "ranks": args.ranks, "rows": rows, "ratios": ratios})
    if args.plot:
        bench.plot(rows, args.plot)
    if tmp:
        tmp.cleanup()
    return 1 if any(r["errors"] for r in rows) else 0


def _estimate(
    bench,
    ds,
    args,
    worker_counts: list[int],
    peers: list[str],
    max_tokens: int | None,
    step_ms: float,
    max_batches: int | None,
) -> str:
    """One line saying how long the bench will take, printed before the first run."""
    epoch = bench.batches_per_rank_estimate(ds, args.ranks, args.batch_size, max_tokens)
    batches = min(epoch, max_batches) if max_batches else epoch
    runs = len(worker_counts) * (1 + len(peers))
    total = runs * bench.estimate_run_s(batches, step_ms)
    how = (
        f"{batches} batches per rank at a {step_ms:.1f} ms step"
        if step_ms > 0
        else f"{batches} batches per rank (one epoch) at loader speed, no step"
    )
    return (
        f"estimate: {runs} run(s) (readers {', '.join(['shardtool', *peers])} at num_workers "
        f"{','.join(map(str, worker_counts))}), each {args.ranks} rank(s) × {how}: about {total:.0f} s in all "
        f"(--max-batches or --seconds to change; --timeout {args.timeout:g} s per run)"
    )
