"""ShardedLoader vs webdataset, measured in the same run on the same tar shards.

Token corpus (lognormal lengths, median ~350, int32 tokens): samples/s, tokens/s, MB/s, time
to first batch, time to first batch after resuming at 90% of the epoch, padding efficiency
and peak RSS, with num_workers 0 and 2. Image-like corpus (~100 KB binary samples): MB/s.
The peer uses its recommended set-up: WebDataset (shard shuffle + sample shuffle buffer),
decoding npy to numpy and padding into a LongTensor batch inside the pipeline, WebLoader.
Each measurement runs in its own process so that peak RSS is its own. After one warm-up of
each side (page cache, imports), every configuration is measured ``--repeats`` times, ours and
the peer back to back in alternating order; the table gives medians, and each ratio is the
median of the per-round ratios with its min-max range (the noise of a shared machine). A steady
state measurement stops after ``--max-seconds`` (both sides alike: same corpus, same rate).

    python -m benchmarks.loader_throughput [--small] [--dir DIR] [--repeats 3] [--max-seconds 30] [--json]

``--compression zstd|lz4`` measures instead the token corpus (random ids) packed as Arrow shards
plain and compressed, plus a corpus 3x larger: ShardedLoader samples/s of each, through a warmed
node cache (the compressed shards decompressed there) and read in place (the rank decompresses
its share into memory once), num_workers 0 and 2, ``--passes`` passes a run, alternating, medians,
the first batch's time, and the compressed/plain ratio against its target (cache >= 0.95x, in
place >= 0.5x); benchmarks/compressed_reads.py.

    python -m benchmarks.loader_throughput --compression zstd [--modes cache,inplace] [--corpora tokens,big]

Peers (`benchmarks.peers`: MosaicML Streaming on MDSWriter shards, LitData on ``optimize()``
output, Megatron-Energon on its prepared WebDataset), each when its package imports: written once
from the same tar shards with the peer's own writer, read shuffled with its own loader into the
same batches as webdataset's (128 padded samples, or 32 images), and measured alongside in the
same alternating rounds; one ratio per peer. Before timing, every side reads one whole epoch of
each corpus and is checked: samples, unique keys, and the sum of per-sample crc32 of key and
payload against the tar shards (``--no-verify`` skips it). ``--peers a,b`` picks peers.

``--metrics-overhead`` measures instead what the loader's metrics cost: the token corpus with
num_workers 0 and 2, metrics on (counters, a metric line every 100 steps) against
``metrics=False``, paired and alternating like the peer comparison; target: within 3% tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # the checkout, also via shardtool/benchmarks
sys.path.insert(0, ROOT)

# Below the path insert: each measurement runs this file as a script (``--one``, a process of its
# own), where shardtool is importable only through ROOT.
from shardtool.benchmarks.compressed_reads import compression_runs, print_compression  # noqa: E402
from shardtool.benchmarks.loader_corpus import write_images, write_tokens  # noqa: E402
from shardtool.benchmarks.loader_report import print_results  # noqa: E402
from shardtool.benchmarks.loader_rounds import (  # noqa: E402
    measure,
    metrics_overhead,
    paired_sides,
    prepare_peers,
    verify_sides,
)
from shardtool.benchmarks.loader_runs import one  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="20k token samples, 1,500 images (a quick run)")
    p.add_argument(
        "--tiny", action="store_true", help="2,000 token samples, 120 images, no warm-up runs (the smoke test)"
    )
    p.add_argument("--dir", default=None, help="where to write the corpora (default: a temp dir)")
    p.add_argument("--repeats", type=int, default=3, help="measurements per configuration and side (median)")
    p.add_argument(
        "--max-seconds",
        type=float,
        default=30.0,
        help="stop a steady-state measurement after this long (both sides alike)",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--compression",
        choices=["zstd", "lz4"],
        help="instead of the peer comparison: Arrow shards compressed with this codec against plain ones, "
        "through a warmed node cache and read in place (see --modes)",
    )
    p.add_argument("--modes", default="cache,inplace", help="with --compression: cache, inplace or both")
    p.add_argument(
        "--corpora",
        default="tokens,big",
        help="with --compression: tokens (the 200k-sample corpus), big (3x larger: its decompressed "
        "batches exceed the 256 MiB a process kept before), or both",
    )
    p.add_argument(
        "--metrics-overhead",
        action="store_true",
        help="measure metrics on vs off (tokens/s, num_workers 0 and 2) instead of the peer comparison",
    )
    p.add_argument(
        "--peers",
        default=None,
        help="comma-separated peers to measure besides webdataset (default: every one installed; "
        "'none' for none): streaming, litdata, energon",
    )
    p.add_argument("--no-verify", action="store_true", help="skip the whole-epoch check of every side's read")
    p.add_argument(
        "--one", choices=["ours", "ours-nometrics", "wds", "streaming", "litdata", "energon"], help=argparse.SUPPRESS
    )
    p.add_argument("--verify", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--kind", choices=["tokens", "images"], help=argparse.SUPPRESS)
    p.add_argument("--workers", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", help=argparse.SUPPRESS)
    p.add_argument(
        "--passes",
        type=int,
        default=3,
        help="with --compression: passes a run reads (the rate is over all of them; default 3)",
    )
    p.add_argument(
        "--samples",
        type=int,
        default=None,
        help="with --compression: samples of the tokens corpus (default 200,000; 20,000 with --small)",
    )
    p.add_argument(
        "--shuffle-block",
        default=None,
        help="with --compression: our loader's shuffle_block, in samples or 'shard' (the dataset's "
        "samples per shard): a pass reads a shard or two at a time (default: the full shuffle)",
    )
    args = p.parse_args()
    if args.one:
        return one(args)
    if args.compression:
        n_tok = args.samples or (20_000 if args.small else 200_000)
        sizes = {"tokens": n_tok, "big": 3 * n_tok}
        corpora = {c: sizes[c] for c in args.corpora.split(",")}
        base = args.dir or tempfile.mkdtemp(prefix="loader-bench-")
        print(
            f"corpora in {base}; {args.repeats} alternating runs per configuration, at most {args.max_seconds:g} s "
            "each",
            file=sys.stderr,
        )
        compressed = compression_runs(
            lambda root, w, cache_dir, passes: measure(
                "ours",
                root,
                "tokens",
                w,
                max_s=args.max_seconds,
                cache_dir=cache_dir,
                passes=passes,
                shuffle_block=args.shuffle_block,
            ),
            base,
            corpora,
            args.compression,
            args.repeats,
            tuple(args.modes.split(",")),
            args.passes,
        )
        if args.json:
            print(json.dumps(compressed, indent=1))
        else:
            print_compression(compressed, args.compression)
        return

    n_tok, n_img = (2_000, 120) if args.tiny else (20_000, 1_500) if args.small else (200_000, 4_000)
    base = args.dir or tempfile.mkdtemp(prefix="loader-bench-")
    tok, img = os.path.join(base, "tokens"), os.path.join(base, "images")
    t = time.perf_counter()
    if not os.path.exists(os.path.join(tok, "index.json")):
        os.makedirs(tok, exist_ok=True)
        write_tokens(tok, n_tok, 500 if args.tiny else 10_000)
    if not args.metrics_overhead and not os.path.exists(os.path.join(img, "index.json")):
        os.makedirs(img, exist_ok=True)
        write_images(img, n_img, 30 if args.tiny else 500)
    print(
        f"corpora in {base} ({time.perf_counter() - t:.1f} s): {n_tok:,} token samples, {n_img:,} images; "
        f"{args.repeats} paired runs per configuration, at most {args.max_seconds:g} s each",
        file=sys.stderr,
    )

    if args.metrics_overhead:
        return metrics_overhead(tok, args.repeats, args.max_seconds, args.json)
    results, ratio_runs = {}, {}
    configs = [
        ("tokens", 0, "tokens samples/s ours/wds w0"),
        ("tokens", 2, "tokens samples/s ours/wds w2"),
        ("images", 2, "images MB/s ours/wds w2"),
    ]
    from shardtool.benchmarks import peers as peer_mods

    installed = list(peer_mods.available())
    chosen = installed if args.peers is None else [x for x in args.peers.split(",") if x and x != "none"]
    if set(chosen) - set(installed):
        raise SystemExit(
            f"peers not importable here: {sorted(set(chosen) - set(installed))} "
            f"({peer_mods.missing()}); bash benchmarks/setup_peers.sh builds a venv with them"
        )
    sides = ["ours", "wds"] + chosen
    peer_info = prepare_peers(chosen, tok, img)
    checked = None if args.no_verify else verify_sides(sides, tok, img)
    for kind, w, name in configs:
        pair, per_peer = paired_sides(
            tok if kind == "tokens" else img, kind, w, args.repeats, args.max_seconds, sides, warm=not args.tiny
        )
        for peer, runs_ in per_peer.items():
            ratio_runs[name.replace("/wds", "/" + peer)] = runs_
        for which in sides:
            results[f"{kind}/{which}/w{w}"] = pair[which]
        if kind == "tokens":
            # One resumed first batch per round; each over that round's fresh first batch.
            ours = results[f"tokens/ours/w{w}"]
            resumed = [measure("ours", tok, "tokens", w, True)["first_batch_s"] for _ in range(args.repeats)]
            ours["resume_first_batch_s"] = statistics.median(resumed)
            ratio_runs[f"resume/fresh first batch w{w}"] = [
                b / a for a, b in zip(ours["first_batch_runs_s"], resumed, strict=True)
            ]
    ratios = {name: statistics.median(v) for name, v in ratio_runs.items()}
    if args.json:
        print(
            json.dumps(
                {
                    "results": results,
                    "ratios": ratios,
                    "ratio_runs": ratio_runs,
                    "peers": peer_info,
                    "peers_missing": peer_mods.missing(),
                    "verified": checked,
                },
                indent=1,
            )
        )
        return
    print_results(results, ratios, ratio_runs, peer_info, peer_mods.missing(), checked)


if __name__ == "__main__":
    main()
