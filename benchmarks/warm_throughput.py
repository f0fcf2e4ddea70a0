"""Warm throughput: `shardtool warm` vs `cp -r` on a local source, and 1 vs 8 jobs against a
source with per-request latency (tests/faultfs.py). Prints GB/s and ratios; not a timed test.

    python benchmarks/warm_throughput.py [--shards 32] [--shard-mb 32] [--latency 0.05]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))

import faultfs  # noqa: E402,F401  registers faulty://
from cachedata import make_dataset  # noqa: E402
from cache import RetryPolicy, warm  # noqa: E402


def drop(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=32)
    ap.add_argument("--shard-mb", type=float, default=32)
    ap.add_argument("--latency", type=float, default=0.05, help="seconds per request on the slow source")
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    work = a.dir or tempfile.mkdtemp(prefix="warm-bench-")
    src = os.path.join(work, "src")
    samples = 16
    if not os.path.exists(os.path.join(src, "index.json")):
        make_dataset(src, shards=a.shards, samples=samples, sample_bytes=int(a.shard_mb * 1e6 / samples), replicate=False)
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(src) for f in fs)
    print(f"dataset: {a.shards} shards, {total / 1e9:.3f} GB at {src}")
    subprocess.run(["cat"] + [os.path.join(d, f) for d, _, fs in os.walk(src) for f in fs],
                   stdout=subprocess.DEVNULL, check=True)  # page cache warm for both contenders

    cp_t, cps_t, warm_t = [], [], []
    for _ in range(a.repeat):
        dst = os.path.join(work, "cp")
        drop(dst)
        subprocess.run(["sync"], check=True)
        cp_t.append(timed(lambda: subprocess.run(["cp", "-r", src, dst], check=True)))
        drop(dst)
        subprocess.run(["sync"], check=True)
        # warm fsyncs every shard before publishing it; `cp -r; sync` is the durable peer
        cps_t.append(timed(lambda: subprocess.run(f"cp -r '{src}' '{dst}' && sync", shell=True, check=True)))
        drop(dst)
        subprocess.run(["sync"], check=True)
        cache = os.path.join(work, "cache")
        drop(cache)
        warm_t.append(timed(lambda: warm(src, cache, all_shards=True, jobs=8, progress=False)))
        drop(cache)
    cp_best, cps_best, warm_best = min(cp_t), min(cps_t), min(warm_t)
    print(f"local:  cp -r {total / cp_best / 1e9:6.2f} GB/s ({cp_best:.2f}s)   cp -r + sync "
          f"{total / cps_best / 1e9:6.2f} GB/s ({cps_best:.2f}s)   warm -j8 {total / warm_best / 1e9:6.2f} GB/s "
          f"({warm_best:.2f}s)")
    print(f"local:  warm/cp time ratio {warm_best / cp_best:.2f}   warm/(cp+sync) time ratio {warm_best / cps_best:.2f}")

    url = "faulty://" + src
    opts = {"latency": a.latency}
    policy = RetryPolicy(stall_timeout=60)
    res = {}
    for jobs in (1, 8):
        cache = os.path.join(work, f"cache-lat-{jobs}")
        drop(cache)
        r = warm(url, cache, all_shards=True, jobs=jobs, storage_options=opts, retry=policy, progress=False)
        if r.status != "ok":
            raise SystemExit(f"warm failed: {r.error}")
        res[jobs] = r.seconds
        print(f"latency {a.latency * 1000:.0f} ms/request, -j{jobs}: {r.bytes_copied / r.seconds / 1e9:6.3f} GB/s ({r.seconds:.2f}s)")
        drop(cache)
    print(f"latency source: 8 jobs / 1 job speedup {res[1] / res[8]:.2f}x")
    if not a.dir:
        drop(work)


if __name__ == "__main__":
    main()
