"""ShardedLoader vs webdataset, measured in the same run on the same tar shards.

Token corpus (lognormal lengths, median ~350, int32 tokens): samples/s, tokens/s, MB/s, time
to first batch, time to first batch after resuming at 90% of the epoch, padding efficiency
and peak RSS, with num_workers 0 and 2. Image-like corpus (~100 KB binary samples): MB/s.
The peer uses its recommended set-up: WebDataset (shard shuffle + sample shuffle buffer),
decoding npy to numpy and padding into a LongTensor batch inside the pipeline, WebLoader.
Each measurement runs in its own process so that peak RSS is its own.

    python benchmarks/loader_throughput.py [--small] [--dir DIR] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MAX_TOKENS = 65536
WDS_BATCH = 128  # about the samples per 65,536-token batch of our loader on this corpus
IMAGE_BATCH = 32


# ---------------------------------------------------------------------- corpora
def write_tokens(root: str, n: int, per_shard: int) -> None:
    from shardtool.format import FieldSpec, Manifest, ShardFileWriter, publish_manifest

    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(350), 0.8, n), 1, 8192).astype(np.int64)
    fields = [FieldSpec("tokens", "tokens.npy", "npy", "array", "i4")]
    vocab = rng.integers(0, 50_000, size=int(lengths.max()) + 1024, dtype=np.int32)
    infos, lens = [], []
    for s, a in enumerate(range(0, n, per_shard)):
        w = ShardFileWriter(root, f"tok-{s:05d}.tar", "tar", fields)
        for g in range(a, min(n, a + per_shard)):
            o = g % 1024
            w.add(f"t{g:08d}", [vocab[o : o + lengths[g]]], int(lengths[g]))
        info, ln = w.finish()
        infos.append(info)
        lens.append(ln)
    publish_manifest(root, Manifest("tar", fields, infos, {"field": "tokens", "unit": "tokens", "fn": None}),
                     np.concatenate(lens))


def write_images(root: str, n: int, per_shard: int) -> None:
    from shardtool.format import FieldSpec, Manifest, ShardFileWriter, publish_manifest

    rng = np.random.default_rng(1)
    blob = rng.integers(0, 256, size=200_000, dtype=np.uint8).tobytes()
    sizes = rng.integers(80_000, 120_000, size=n)
    fields = [FieldSpec.raw("jpg")]
    infos, lens = [], []
    for s, a in enumerate(range(0, n, per_shard)):
        w = ShardFileWriter(root, f"img-{s:05d}.tar", "tar", fields)
        for g in range(a, min(n, a + per_shard)):
            w.add(f"i{g:08d}", [blob[g % 997 : g % 997 + sizes[g]]], int(sizes[g]))
        info, ln = w.finish()
        infos.append(info)
        lens.append(ln)
    publish_manifest(root, Manifest("tar", fields, infos, {"field": None, "unit": "bytes", "fn": None}),
                     np.concatenate(lens))


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


def run_wds(root: str, kind: str, workers: int) -> dict:
    import webdataset as wds

    urls = sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith(".tar"))
    began = time.perf_counter()
    ds = wds.WebDataset(urls, shardshuffle=len(urls), empty_check=False, seed=0).shuffle(1000)
    if kind == "tokens":
        ds = ds.decode().to_tuple("__key__", "tokens.npy").batched(WDS_BATCH, collation_fn=wds_pad, partial=True)
    else:
        ds = ds.to_tuple("__key__", "jpg").batched(IMAGE_BATCH, collation_fn=wds_bytes, partial=True)
    loader = wds.WebLoader(ds, batch_size=None, num_workers=workers)
    return consume(loader, kind, began)


def run_ours(root: str, kind: str, workers: int, resume: bool) -> dict:
    from loader import ShardedLoader
    from loader.state import LoaderState

    began = time.perf_counter()
    size = {"max_tokens": MAX_TOKENS} if kind == "tokens" else {"batch_size": IMAGE_BATCH}
    ld = ShardedLoader(root, num_workers=workers, pin_memory=False, **size)
    if resume:
        served = int(len(ld) * 0.9)
        ld.load_state_dict(LoaderState.start(0, ld.fingerprint, ld.batching, ld.layout).with_served(served).to_dict())
    out = consume(ld, kind, began, first_only=resume)
    out["padding_efficiency"] = ld.padding_efficiency if kind == "tokens" else None
    return out


def consume(loader, kind: str, began: float, first_only: bool = False) -> dict:
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
    el = time.perf_counter() - began_steady if not first_only else 0
    # Steady-state rates exclude the first batch (start-up is reported separately).
    return {"first_batch_s": first, "seconds": el, "samples_per_s": samples / el if el else None,
            "tokens_per_s": tokens / el if el else None, "mb_per_s": nbytes / el / 1e6 if el else None,
            "padding_efficiency": real / padded if padded else None,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "workers_peak_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}


def one(args) -> None:
    if args.one == "wds":
        out = run_wds(args.root, args.kind, args.workers)
    else:
        out = run_ours(args.root, args.kind, args.workers, args.resume)
    print(json.dumps(out))


def measure(which: str, root: str, kind: str, workers: int, resume: bool = False) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", which, "--root", root, "--kind", kind,
           "--workers", str(workers)] + (["--resume"] if resume else [])
    env = {**os.environ, "PYTHONPATH": ROOT}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if res.returncode:
        raise SystemExit(f"{which} {kind} w={workers} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------- report
def fmt(v, spec=",.0f") -> str:
    return "n/a" if v is None else format(v, spec)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="20k token samples, 600 images (a quick run)")
    p.add_argument("--dir", default=None, help="where to write the corpora (default: a temp dir)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--one", choices=["ours", "wds"], help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--kind", choices=["tokens", "images"], help=argparse.SUPPRESS)
    p.add_argument("--workers", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        return one(args)

    n_tok, n_img = (20_000, 600) if args.small else (200_000, 4_000)
    base = args.dir or tempfile.mkdtemp(prefix="loader-bench-")
    tok, img = os.path.join(base, "tokens"), os.path.join(base, "images")
    t = time.perf_counter()
    if not os.path.exists(os.path.join(tok, "index.json")):
        os.makedirs(tok, exist_ok=True)
        write_tokens(tok, n_tok, 10_000)
    if not os.path.exists(os.path.join(img, "index.json")):
        os.makedirs(img, exist_ok=True)
        write_images(img, n_img, 500)
    print(f"corpora in {base} ({time.perf_counter() - t:.1f} s): {n_tok:,} token samples, {n_img:,} images",
          file=sys.stderr)

    results = {}
    for w in (0, 2):
        for which in ("ours", "wds"):
            measure(which, tok, "tokens", w)  # warm the page cache and imports for both alike
            results[f"tokens/{which}/w{w}"] = measure(which, tok, "tokens", w)
        results[f"tokens/ours/w{w}"]["resume_first_batch_s"] = measure("ours", tok, "tokens", w, True)["first_batch_s"]
    for which in ("ours", "wds"):
        measure(which, img, "images", 2)
        results[f"images/{which}/w2"] = measure(which, img, "images", 2)

    ratios = {
        "tokens samples/s ours/wds w0": results["tokens/ours/w0"]["samples_per_s"] / results["tokens/wds/w0"]["samples_per_s"],
        "tokens samples/s ours/wds w2": results["tokens/ours/w2"]["samples_per_s"] / results["tokens/wds/w2"]["samples_per_s"],
        "images MB/s ours/wds w2": results["images/ours/w2"]["mb_per_s"] / results["images/wds/w2"]["mb_per_s"],
        "resume/fresh first batch w0": results["tokens/ours/w0"]["resume_first_batch_s"] / results["tokens/ours/w0"]["first_batch_s"],
        "resume/fresh first batch w2": results["tokens/ours/w2"]["resume_first_batch_s"] / results["tokens/ours/w2"]["first_batch_s"],
    }
    if args.json:
        print(json.dumps({"results": results, "ratios": ratios}, indent=1))
        return
    head = f"{'run':<18}{'samples/s':>12}{'tokens/s':>14}{'MB/s':>9}{'1st batch':>11}{'resume 90%':>12}{'pad eff':>9}{'RSS MB':>9}{'wkr RSS':>9}"
    print(head)
    for name, r in results.items():
        print(f"{name:<18}{fmt(r['samples_per_s']):>12}{fmt(r['tokens_per_s']):>14}{fmt(r['mb_per_s']):>9}"
              f"{fmt(r['first_batch_s'], '.3f'):>11}{fmt(r.get('resume_first_batch_s'), '.3f'):>12}"
              f"{fmt(r['padding_efficiency'], '.3f'):>9}{fmt(r['peak_rss_mb']):>9}{fmt(r['workers_peak_rss_mb']):>9}")
    targets = {"tokens samples/s ours/wds w0": 50, "tokens samples/s ours/wds w2": 10, "images MB/s ours/wds w2": 2,
               "resume/fresh first batch w0": None, "resume/fresh first batch w2": None}
    for k, v in ratios.items():
        goal = targets[k]
        note = (f"(target >= {goal}x: {'met' if v >= goal else 'MISSED'})" if goal
                else f"(target <= 1.5x: {'met' if v <= 1.5 else 'MISSED'})")
        print(f"{k:<32}{v:8.2f}x  {note}")


if __name__ == "__main__":
    main()
