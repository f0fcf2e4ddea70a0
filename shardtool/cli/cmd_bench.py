"""`shardtool bench`: loader throughput per node, side by side with peers, in one run."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile

HELP = "benchmark loader throughput per node (G ranks × workers) and data-wait fraction, vs peers"
DESCRIPTION = """\
Runs G loader ranks on this node as real processes (as torchrun would), each with its own
workers, consuming batches like a training loop with a simulated step time, and reports per
node: samples/s, tokens/s, MB/s, time to first batch, padding efficiency, peak RSS (the largest
rank process's own peak, its workers not counted; every side's imports are loaded in each rank), and the
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
and prints the ratio shardtool / peer. webdataset reads them as they are; streaming (MosaicML
Streaming), litdata and energon (Megatron-Energon), when their packages import (their own venv:
benchmarks/setup_peers.sh), each read a copy of the shards their own writer made before the runs,
untimed (MDSWriter, litdata.optimize, energon prepare), kept in --peer-dir and reused.

  shardtool bench DATASET --ranks 2 --workers 0,2 --max-tokens 65536 --step-ms 50 \\
      --compare webdataset,streaming,litdata,energon --peer-dir /tmp/peer-copies
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
    p.add_argument("--compare", default="", help="comma-separated peers: webdataset, streaming, litdata, energon")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds per --workers value, the readers' order rotating each round; medians, with the "
        "data-wait fraction's min-max (default 1)",
    )
    p.add_argument(
        "--peer-dir",
        default=None,
        help="where streaming, litdata and energon keep their copies of the dataset, made once and "
        "reused (default: a temp dir, removed at the end)",
    )
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
    if set(peers) & set(bench.PEERS) and length_ext != "tokens.npy":
        print(
            f"shardtool bench: --compare {','.join(sorted(set(peers) & set(bench.PEERS)))} copies a token "
            f"field stored as tokens.npy; this dataset's length field is {length_field!r} ({length_ext})",
            file=sys.stderr,
        )
        return 2
    try:
        peer_roots, peer_tmp = _peer_copies(bench, ds, peers, args.peer_dir)
    except (ImportError, KeyError) as e:
        print(f"shardtool bench: {e}", file=sys.stderr)
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
        readers = ["shardtool", *peers]
        runs: dict[str, list[dict]] = {name: [] for name in readers}
        for r in range(args.repeats):  # the readers' order rotates each round
            for name in readers[r % len(readers) :] + readers[: r % len(readers)]:
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
                    peer_roots=peer_roots,
                    dist_port=_free_port() if name == "streaming" else None,
                )
                if name == "streaming":
                    from ..benchmarks.peers import streaming

                    streaming.clean()  # its docs: shared memory an earlier run left behind, removed first
                row = bench.summarize(bench.run_node(name, cfg, timeout=args.timeout))
                row["step_ms"], row["max_batches"] = step_ms, max_batches
                runs[name].append(row)
                for error in row["errors"]:
                    print(f"shardtool bench: {name} (workers={workers}) failed: {error}", file=sys.stderr)
        rows += [bench.median_row(runs[name]) for name in readers]
    print(bench.format_table(rows))
    ratios = []
    for peer in peers:
        for mine in (r for r in rows if r["reader"] == "shardtool"):
            theirs = next((r for r in rows if r["reader"] == peer and r["num_workers"] == mine["num_workers"]), None)
            if theirs and theirs["samples_per_s"]:
                ratio = mine["samples_per_s"] / theirs["samples_per_s"]
                ratios.append({"peer": peer, "num_workers": mine["num_workers"], "samples_per_s_ratio": ratio})
                print(f"shardtool / {peer} samples/s at num_workers={mine['num_workers']}: {ratio:.1f}x")
    if args.repeats > 1:
        print(f"(medians of {args.repeats} rounds, the readers' order rotating; wait range: min-max over them)")
    if args.json_path:
        bench.write_json(args.json_path, {"url": url, "ranks": args.ranks, "rows": rows, "ratios": ratios})
    if args.plot:
        bench.plot(rows, args.plot)
    for t in (tmp, peer_tmp):
        if t:
            t.cleanup()
    return 1 if any(r["errors"] for r in rows) else 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _peer_copies(bench, ds, peers: list[str], peer_dir: str | None):
    """({peer: its copy}, temp dir or None): each of streaming, litdata, energon gets the dataset's
    tar shards written in its own format by its own writer, once per dataset version (untimed)."""
    import os

    wanted = [p for p in peers if p in bench.PEERS]
    if not wanted:
        return {}, None
    from ..benchmarks import peers as peer_mods

    have = peer_mods.available()
    for p in wanted:
        if p not in have:
            raise ImportError(
                f"peer {p} is not importable here ({peer_mods.missing().get(p)}); run the bench with the "
                "peers' venv python (bash benchmarks/setup_peers.sh DIR; DIR/bin/python -m shardtool bench ...)"
            )
    tmp = None
    if peer_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="shardtool-bench-peers-")
        peer_dir = tmp.name
    base = os.path.join(peer_dir, ds.version.replace(":", "-")[:40])
    src = os.path.join(base, "tars")  # the shards as one flat directory of links, what the writers read
    if not os.path.isdir(src):
        os.makedirs(src + ".tmp", exist_ok=True)
        for i in range(ds.num_shards):
            path = ds.shard_path(i)
            os.symlink(os.path.abspath(path), os.path.join(src + ".tmp", f"{i:06d}-{os.path.basename(path)}"))
        os.rename(src + ".tmp", src)
    roots = {}
    for p in wanted:
        out = os.path.join(base, p)
        if not os.path.isdir(out):
            print(f"preparing {p}'s copy of the dataset in {out} (its own writer; untimed)", file=sys.stderr)
            shutil.rmtree(out + ".tmp", ignore_errors=True)
            have[p].prepare(src, out + ".tmp", "tokens", 2)
            os.rename(out + ".tmp", out)
        roots[p] = out
    return roots, tmp


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
    runs = len(worker_counts) * (1 + len(peers)) * args.repeats
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
