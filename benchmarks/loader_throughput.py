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
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # the checkout, also via shardtool/benchmarks
sys.path.insert(0, ROOT)

from shardtool.benchmarks.compressed_reads import compression_runs, print_compression  # noqa: E402
from shardtool.cli._plan import peak_rss_mb  # noqa: E402

MAX_TOKENS = 65536
WDS_BATCH = 128  # about the samples per 65,536-token batch of our loader on this corpus
IMAGE_BATCH = 32


# ---------------------------------------------------------------------- corpora
def write_tokens(root: str, n: int, per_shard: int) -> None:
    """The lognormal token corpus (median ~350, int32), tar shards at the top of ``root``."""
    from shardtool.pack.synthetic import write_synthetic

    write_synthetic(
        root, n, samples_per_shard=per_shard, vocab=50_000, key_prefix="t", key_width=8, shard_name="tok-{:05d}"
    )


def write_images(root: str, n: int, per_shard: int) -> None:
    """Image-like samples: one raw ``jpg`` field of 50-150 KB of random bytes."""
    from shardtool.pack.synthetic import write_synthetic

    write_synthetic(
        root,
        n,
        samples_per_shard=per_shard,
        kind="bytes",
        field="jpg",
        sample_bytes=100_000,
        seed=1,
        key_prefix="i",
        key_width=8,
        shard_name="img-{:05d}",
    )


# ---------------------------------------------------------------------- one measurement (own process)
def wds_pad(samples):
    import torch

    keys = [s[0] for s in samples]
    arrs = [s[1] for s in samples]
    counts = np.array([len(a) for a in arrs], dtype=np.int64)
    out = np.zeros((len(arrs), int(counts.max())), dtype=np.int64)
    for r, a in enumerate(arrs):
        out[r, : len(a)] = a
    return {"__key__": keys, "tokens": torch.from_numpy(out), "lengths": torch.from_numpy(counts)}


def wds_bytes(samples):
    return {"__key__": [s[0] for s in samples], "jpg": [s[1] for s in samples]}


def run_wds(root: str, kind: str, workers: int, max_s: float) -> dict:
    import webdataset as wds

    urls = sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith(".tar"))
    began = time.perf_counter()
    ds = wds.WebDataset(urls, shardshuffle=len(urls), empty_check=False, seed=0).shuffle(1000)
    if kind == "tokens":
        ds = ds.decode().to_tuple("__key__", "tokens.npy").batched(WDS_BATCH, collation_fn=wds_pad, partial=True)
    else:
        ds = ds.to_tuple("__key__", "jpg").batched(IMAGE_BATCH, collation_fn=wds_bytes, partial=True)
    loader = wds.WebLoader(ds, batch_size=None, num_workers=workers)
    return consume(loader, kind, began, max_s=max_s)


def run_ours(
    root: str,
    kind: str,
    workers: int,
    resume: bool,
    max_s: float,
    metrics: bool = True,
    cache_dir: str | None = None,
    passes: int = 1,
    shuffle_block: str | None = None,
) -> dict:
    from shardtool.loader import ShardedLoader

    began = time.perf_counter()
    size = {"max_tokens": MAX_TOKENS} if kind == "tokens" else {"batch_size": IMAGE_BATCH}
    if shuffle_block:
        size["shuffle_block"] = block_samples(root, shuffle_block)
    ld = ShardedLoader(
        root,
        num_workers=workers,
        pin_memory=False,
        metrics=metrics,
        cache_dir=cache_dir,
        metrics_dir=os.path.join(os.path.dirname(root), "metrics"),
        **size,
    )
    if resume:
        served = int(len(ld) * 0.9)
        ld.load_state_dict(ld.planner.start(0, ld.fingerprint, ld.data_layout).with_served(served).to_dict())
    ends: list[tuple[float, int]] = []
    out = consume(_passes(ld, passes, ends), kind, began, first_only=resume, max_s=max_s)
    out["padding_efficiency"] = ld.padding_efficiency if kind == "tokens" else None
    if not resume:
        out.update(pass_rates(began, ends))
    return out


def block_samples(root: str, spec: str) -> int:
    """``--shuffle-block``: a count of samples, or ``shard`` (the dataset's samples per shard)."""
    if spec != "shard":
        return int(spec)
    import shardtool

    m = shardtool.open_dataset(root).manifest
    return max(1, m.num_samples // max(len(m.shards), 1))


def _passes(ld, n: int, ends: list[tuple[float, int]]):
    """``n`` passes of ``ld`` (epochs 0 .. n - 1), one batch stream; each pass's end (time, samples)
    appended to ``ends``."""
    for epoch in range(n):
        ld.set_epoch(epoch)
        samples = 0
        for batch in ld:
            samples += len(batch["__key__"])
            yield batch
        ends.append((time.perf_counter(), samples))


def pass_rates(began: float, ends: list[tuple[float, int]]) -> dict:
    """samples/s of the first pass, from the loader's construction (its start-up, and for a
    compressed share read in place the decompression, included), and of the later ones."""
    if not ends:
        return {}
    out = {"first_pass_samples_per_s": ends[0][1] / (ends[0][0] - began)}
    if len(ends) > 1:
        later = sum(n for _, n in ends[1:])
        out["later_passes_samples_per_s"] = later / (ends[-1][0] - ends[0][0])
    return out


def consume(loader, kind: str, began: float, first_only: bool = False, max_s: float = float("inf")) -> dict:
    samples = tokens = nbytes = real = padded = 0
    first = None
    for batch in loader:
        if first is None:
            first = time.perf_counter() - began
            if first_only:
                break
            began_steady = time.perf_counter()
        samples += len(batch["__key__"])
        if kind == "tokens":
            n = int(batch["lengths"].sum())
            tokens += n
            nbytes += 4 * n
            real += n
            padded += batch["tokens"].numel()
        else:
            nbytes += sum(len(b) for b in batch["jpg"])
        if time.perf_counter() - began_steady > max_s:
            break
    el = time.perf_counter() - began_steady if not first_only else 0
    # Steady-state rates exclude the first batch (start-up is reported separately).
    return {
        "first_batch_s": first,
        "seconds": el,
        "samples_per_s": samples / el if el else None,
        "tokens_per_s": tokens / el if el else None,
        "mb_per_s": nbytes / el / 1e6 if el else None,
        "padding_efficiency": real / padded if padded else None,
        "peak_rss_mb": peak_rss_mb(),  # VmHWM: ru_maxrss would carry the benchmark parent's peak
        "workers_peak_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    }


def run_peer(name: str, root: str, kind: str, workers: int, max_s: float, verify: bool = False) -> dict:
    """A peer's shuffled read of its own copy of the corpus (``<root>-<name>``), as ``run_wds``."""
    from shardtool.benchmarks import peers

    mod = peers.available()[name]
    began = time.perf_counter()
    loader = mod.loader(f"{root}-{name}", kind, workers, WDS_BATCH if kind == "tokens" else IMAGE_BATCH)
    if verify:
        return verify_read(loader, kind)
    return consume(loader, kind, began, max_s=max_s)


def verify_read(loader, kind: str) -> dict:
    """One whole epoch: samples, unique keys and the sum of per-sample checksums (benchmarks.peers)."""
    from shardtool.benchmarks.peers import batch_fingerprint

    keys: list[str] = []
    total = 0
    for batch in loader:
        k, c = batch_fingerprint(batch, kind)
        keys += k
        total += c
    return {"samples": len(keys), "unique": len(set(keys)), "checksum": total}


def one(args) -> None:
    if args.one not in ("wds", "ours", "ours-nometrics"):
        out = run_peer(args.one, args.root, args.kind, args.workers, args.max_seconds, args.verify)
    elif args.verify and args.one == "wds":
        import webdataset as wds

        urls = sorted(os.path.join(args.root, f) for f in os.listdir(args.root) if f.endswith(".tar"))
        ds = wds.WebDataset(urls, shardshuffle=len(urls), empty_check=False, seed=0).shuffle(1000)
        ds = (
            ds.decode().to_tuple("__key__", "tokens.npy").batched(WDS_BATCH, collation_fn=wds_pad, partial=True)
            if args.kind == "tokens"
            else ds.to_tuple("__key__", "jpg").batched(IMAGE_BATCH, collation_fn=wds_bytes, partial=True)
        )
        out = verify_read(wds.WebLoader(ds, batch_size=None, num_workers=args.workers), args.kind)
    elif args.verify:
        from shardtool.loader import ShardedLoader

        size = {"max_tokens": MAX_TOKENS} if args.kind == "tokens" else {"batch_size": IMAGE_BATCH}
        out = verify_read(
            ShardedLoader(args.root, num_workers=args.workers, pin_memory=False, metrics=False, **size), args.kind
        )
    elif args.one == "wds":
        out = run_wds(args.root, args.kind, args.workers, args.max_seconds)
    else:
        out = run_ours(
            args.root,
            args.kind,
            args.workers,
            args.resume,
            args.max_seconds,
            args.one == "ours",
            args.cache_dir,
            args.passes,
            args.shuffle_block,
        )
    print(json.dumps(out))


def measure(
    which: str,
    root: str,
    kind: str,
    workers: int,
    resume: bool = False,
    max_s: float = 30.0,
    cache_dir: str | None = None,
    verify: bool = False,
    passes: int = 1,
    shuffle_block: str | None = None,
) -> dict:
    """One run in its own process; ``which``: "ours", "ours-nometrics" (metrics=False), "wds" or a peer."""
    cmd = (
        [
            sys.executable,
            os.path.abspath(__file__),
            "--one",
            which,
            "--root",
            root,
            "--kind",
            kind,
            "--workers",
            str(workers),
            "--max-seconds",
            str(max_s),
        ]
        + (["--resume"] if resume else [])
        + (["--cache-dir", cache_dir] if cache_dir else [])
        + (["--passes", str(passes)] if passes != 1 else [])
        + (["--shuffle-block", shuffle_block] if shuffle_block else [])
    )
    cmd += ["--verify"] if verify else []
    env = {**os.environ, "PYTHONPATH": ROOT}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if res.returncode:
        raise SystemExit(
            f"{which} {kind} w={workers} failed (exit {res.returncode}; {' '.join(cmd)}):\n{res.stderr[-3000:]}"
        )
    return json.loads(res.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------- report
def fmt(v, spec=",.0f") -> str:
    return "n/a" if v is None else format(v, spec)


def paired(root: str, kind: str, workers: int, repeats: int, max_s: float) -> tuple[dict, list[float]]:
    """Ours and the peer, back to back, alternating who goes first; medians and per-round ratios."""
    metric = "samples_per_s" if kind == "tokens" else "mb_per_s"
    for which in ("ours", "wds"):
        measure(which, root, kind, workers, max_s=max_s)  # warm the page cache and imports for both alike
    runs: dict[str, list[dict]] = {"ours": [], "wds": []}
    ratios = []
    for r in range(repeats):
        for which in ("ours", "wds") if r % 2 == 0 else ("wds", "ours"):
            runs[which].append(measure(which, root, kind, workers, max_s=max_s))
        ratios.append(runs["ours"][-1][metric] / runs["wds"][-1][metric])
    out = {}
    for which, rs in runs.items():
        med = {k: (statistics.median(r[k] for r in rs) if rs[0][k] is not None else None) for k in rs[0]}
        med["spread"] = (min(r[metric] for r in rs), max(r[metric] for r in rs))
        out[which] = med
    return out, ratios


def paired_sides(
    root: str, kind: str, workers: int, repeats: int, max_s: float, sides: list[str], warm: bool = True
) -> tuple[dict, dict[str, list[float]]]:
    """``paired`` for ours and every peer in ``sides``: each round runs all sides, the order rotating;
    per peer, the per-round ratio ours/peer."""
    metric = "samples_per_s" if kind == "tokens" else "mb_per_s"
    for which in sides if warm else ():
        measure(which, root, kind, workers, max_s=max_s)  # warm-up, alike for all
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    ratios: dict[str, list[float]] = {s: [] for s in sides if s != "ours"}
    for r in range(repeats):
        k = r % len(sides)
        for which in sides[k:] + sides[:k]:
            runs[which].append(measure(which, root, kind, workers, max_s=max_s))
        for peer in ratios:
            ratios[peer].append(runs["ours"][-1][metric] / runs[peer][-1][metric])
    out = {}
    for which, rs in runs.items():
        med = {k: (statistics.median(r[k] for r in rs) if rs[0][k] is not None else None) for k in rs[0]}
        med["spread"] = (min(r[metric] for r in rs), max(r[metric] for r in rs))
        med["first_batch_runs_s"] = [r["first_batch_s"] for r in rs]
        out[which] = med
    return out, ratios


def prepare_peers(names: list[str], tok: str, img: str) -> dict[str, dict]:
    """Each peer's copy of both corpora in its own format (``<root>-<peer>``), written once; versions."""
    from shardtool.benchmarks import peers

    mods = peers.available()
    info = {}
    for name in names:
        info[name] = {"version": mods[name].version()}
        for root, kind in ((tok, "tokens"), (img, "images")):
            if not os.path.isdir(f"{root}-{name}"):
                t = time.perf_counter()
                mods[name].prepare(root, f"{root}-{name}.tmp", kind, 2)
                os.rename(f"{root}-{name}.tmp", f"{root}-{name}")
                info[name][f"prepare_{kind}_s"] = time.perf_counter() - t
    return info


def verify_sides(sides: list[str], tok: str, img: str, workers: tuple[int, ...] = (0, 2)) -> dict:
    """Every side's whole epoch of each corpus, checked against the tar shards; raises on a mismatch."""
    from shardtool.benchmarks.peers import expected

    checked = {}
    for root, kind in ((tok, "tokens"), (img, "images")):
        n, total = expected(root, kind)
        for which in sides:
            for w in workers if kind == "tokens" else (2,):
                got = measure(which, root, kind, w, verify=True)
                if (got["samples"], got["unique"], got["checksum"]) != (n, n, total):
                    raise SystemExit(
                        f"{which} {kind} w={w} read {got['samples']} samples ({got['unique']} unique, "
                        f"checksum {'ok' if got['checksum'] == total else 'WRONG'}); "
                        f"the corpus has {n}"
                    )
                checked[f"{kind}/{which}/w{w}"] = got["samples"]
    return checked


def metrics_overhead(tok: str, repeats: int, max_s: float, as_json: bool) -> None:
    """tokens/s with metrics on over off, per round (alternating who goes first); the median."""
    out = {}
    for w in (0, 2):
        for which in ("ours", "ours-nometrics"):
            measure(which, tok, "tokens", w, max_s=max_s)  # warm-up, alike for both
        ratios = []
        for r in range(repeats):
            order = ("ours", "ours-nometrics") if r % 2 == 0 else ("ours-nometrics", "ours")
            got = {which: measure(which, tok, "tokens", w, max_s=max_s)["tokens_per_s"] for which in order}
            ratios.append(got["ours"] / got["ours-nometrics"])
        out[f"metrics on/off tokens/s w{w}"] = {"median": statistics.median(ratios), "runs": ratios}
    if as_json:
        print(json.dumps(out, indent=1))
        return
    for name, r in out.items():
        v = r["median"]
        print(
            f"{name:<32}{v:8.3f}x  [{min(r['runs']):.3f}-{max(r['runs']):.3f}] "
            f"(target >= 0.97x: {'met' if v >= 0.97 else 'MISSED'})"
        )


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
    head = (
        f"{'run':<20}{'samples/s':>12}{'tokens/s':>14}{'MB/s':>9}{'range':>17}{'1st batch':>11}{'resume 90%':>12}"
        f"{'pad eff':>9}{'RSS MB':>9}{'wkr RSS':>9}"
    )
    for name, info in peer_info.items():
        print(f"peer {name}: {info['version']}")
    for name, why in peer_mods.missing().items():
        print(f"peer {name}: not measured, {why}")
    if checked:
        print(f"verified: every side read each corpus whole (count, unique keys, payload crc32): {len(checked)} reads")
    print(head)
    for name, r in results.items():
        lo, hi = r["spread"]
        rng = f"{lo:,.0f}-{hi:,.0f}"
        print(
            f"{name:<20}{fmt(r['samples_per_s']):>12}{fmt(r['tokens_per_s']):>14}{fmt(r['mb_per_s']):>9}{rng:>17}"
            f"{fmt(r['first_batch_s'], '.3f'):>11}{fmt(r.get('resume_first_batch_s'), '.3f'):>12}"
            f"{fmt(r['padding_efficiency'], '.3f'):>9}{fmt(r['peak_rss_mb']):>9}{fmt(r['workers_peak_rss_mb']):>9}"
        )
    print("(range: min-max over the runs of samples/s for tokens, MB/s for images)")
    targets = {"tokens samples/s ours/wds w0": 50, "tokens samples/s ours/wds w2": 10, "images MB/s ours/wds w2": 2}
    for k, v in ratios.items():
        goal = targets.get(k) or (2 if "ours/" in k else None)  # the issue's target against every peer
        if goal:
            runs_ = ratio_runs[k]
            note = f"[{min(runs_):.1f}-{max(runs_):.1f}] (target >= {goal}x: {'met' if v >= goal else 'MISSED'})"
        else:
            runs_ = ratio_runs[k]
            note = f"[{min(runs_):.2f}-{max(runs_):.2f}] (target <= 1.5x: {'met' if v <= 1.5 else 'MISSED'})"
        print(f"{k:<36}{v:8.2f}x  {note}")


if __name__ == "__main__":
    main()
