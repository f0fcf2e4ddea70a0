"""Requests one node makes of an S3 store (issue 38: thousands of nodes against one object store),
counted by a real HTTP proxy in front of moto (tests/helpers/s3proxy.py, tests/helpers/s3server.py).

Packs real text (the first ``--files`` stdlib source files as byte-id tokens, plain Arrow shards),
uploads it to a moto server on 127.0.0.1 and prints, by kind (GET, ranged GET, HEAD, LIST, ...):
the warm of one node (and of the same node again), a 1-rank loader's start-up and one epoch
without a cache and with an empty cache (fetch on miss); then the SlowDown survival runs: the
same warm and cached epoch behind a token bucket of ``--rate`` requests/s answering 503 SlowDown
above it, their time against the ideal (answered requests at that rate, or the unthrottled run
where longer), the 503s answered and the cache's own retries, the bytes and batches checked.

    python -m benchmarks.s3_requests [--files 200] [--shard-size 1000000] [--rate 20] [--burst 5]

From a checkout only (it needs tests/ and moto); not a timed test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))

from helpers.s3proxy import Faults, S3Proxy, stdlib_dataset  # noqa: E402
from helpers.s3server import S3Server  # noqa: E402

COLUMNS = ("GET", "RANGED_GET", "HEAD", "LIST", "PUT", "OTHER")


def _epoch(url, loader_kw, **kw) -> list:
    import torch

    from shardtool.loader import ShardedLoader

    ld = ShardedLoader(url, **loader_kw, **kw)
    return [{k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in b.items()} for b in ld]


def _same_cached_bytes(src: str, report) -> bool:
    from shardtool.cache import VersionDir
    from shardtool.format import open_dataset

    vd = VersionDir(report.cache_dir, report.version)
    for s in open_dataset(src).manifest.shards:
        for rel in (s.path, s.index):
            with open(os.path.join(src, rel), "rb") as a, open(vd.path(rel), "rb") as b:
                if a.read() != b.read():
                    return False
    return True


def _row(label: str, c, seconds: float) -> str:
    kinds = c.kinds()
    other = sum(n for k, n in kinds.items() if k not in COLUMNS[:-1])
    cells = [kinds[k] for k in COLUMNS[:-1]] + [other]
    served = sum(c.bytes_by_key.values())
    return (
        f"{label:<36} {c.total:>6} "
        + " ".join(f"{n:>10}" for n in cells)
        + f" {c.throttled:>5} {c.resets:>6} {served / 1e6:>9.1f} {seconds:>7.2f}"
    )


def _header() -> str:
    return (
        f"{'phase':<36} {'total':>6} "
        + " ".join(f"{k:>10}" for k in COLUMNS)
        + f" {'503':>5} {'resets':>6} {'MB body':>9} {'seconds':>7}"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--files", type=int, default=200, help="stdlib files packed (default 200: 13 shards, 11 MB)")
    ap.add_argument("--shard-size", type=int, default=1_000_000, help="bytes per shard (default 1e6)")
    ap.add_argument("--rate", type=float, default=20.0, help="SlowDown above this many requests/s (default 20)")
    ap.add_argument("--burst", type=int, default=5, help="token bucket burst (default 5)")
    ap.add_argument("--jobs", type=int, default=8, help="warm's parallel transfers (default 8)")
    ap.add_argument("--batch-size", type=int, default=8, help="loader batch size (default 8)")
    ap.add_argument("--dir", help="work directory (default: a temporary one)")
    ap.add_argument(
        "--rounds", type=int, default=1, help="SlowDown runs of each side, alternating (default 1): medians, ranges"
    )
    a = ap.parse_args(argv)

    from shardtool.cache import warm
    from shardtool.format import open_dataset

    work = a.dir or tempfile.mkdtemp(prefix="s3req-")
    # Files too large for one shard are left out (a row must fit), so small shards mean many requests.
    src = stdlib_dataset(os.path.join(work, "ds"), files=a.files, shard_size=a.shard_size, fitting=True)
    m = open_dataset(src).manifest
    loader_kw = dict(batch_size=a.batch_size, num_workers=0, seed=0, rank=0, world_size=1)
    server = S3Server().start()
    try:
        url = server.upload(src, f"bench{int(time.time())}/ds")
        print(
            f"dataset {url}: {len(m.shards)} shards, {m.num_samples} samples, "
            f"{sum(s.bytes for s in m.shards) / 1e6:.1f} MB; objects {3 + 2 * len(m.shards)}"
        )
        want = _epoch(src, loader_kw)
        with S3Proxy(server.endpoint) as proxy:
            opts = proxy.storage_options
            rows = []

            def phase(label, fn):
                proxy.reset()
                began = time.monotonic()
                out = fn()
                took = time.monotonic() - began
                rows.append(_row(label, proxy.counts(), took))
                return out, took

            r, warm_s = phase(
                "warm, one node",
                lambda: warm(url, os.path.join(work, "c-warm"), storage_options=opts, jobs=a.jobs, progress=False),
            )
            assert r.status == "ok", r.summary()
            phase(
                "warm, same node again",
                lambda: warm(url, os.path.join(work, "c-warm"), storage_options=opts, jobs=a.jobs, progress=False),
            )
            from shardtool.loader import ShardedLoader

            ld, _ = phase("loader start-up, no cache", lambda: ShardedLoader(url, storage_options=opts, **loader_kw))
            got, _ = phase("loader epoch, no cache", lambda: [b["__key__"] for b in ld])
            cache = os.path.join(work, "c-loader")
            ld, _ = phase(
                "loader start-up, empty cache",
                lambda: ShardedLoader(url, storage_options=opts, cache_dir=cache, **loader_kw),
            )
            got, _ = phase("loader epoch, fetch on miss", lambda: [b["__key__"] for b in ld])
            got, epoch_s = phase(
                "loader start-up + epoch, full cache",
                lambda: _epoch(url, loader_kw, storage_options=opts, cache_dir=cache),
            )
            assert got == want, "the cached epoch differs from the local one"
            got, epoch_cold_s = phase(
                "loader start-up + epoch, empty cache",
                lambda: _epoch(url, loader_kw, storage_options=opts, cache_dir=os.path.join(work, "c-loader2")),
            )
            print()
            print(_header())
            print("\n".join(rows))

            print(f"\nSlowDown survival: 503 SlowDown above {a.rate:g} requests/s (burst {a.burst})")
            proxy.set_faults(Faults(slowdown_rate=a.rate, slowdown_burst=a.burst))
            runs: dict[str, list[tuple[float, float, int, Any, bool]]] = {"warm": [], "epoch": []}
            for k in range(a.rounds):  # the sides alternate: warm, then an epoch, round after round
                rows = []
                r, took = phase(
                    "warm, one node, SlowDown",
                    lambda k=k: warm(
                        url, os.path.join(work, f"c-slow{k}"), storage_options=opts, jobs=a.jobs, progress=False
                    ),
                )
                cw = proxy.counts()
                ideal = max(max(cw.forwarded - a.burst, 0) / a.rate, warm_s)
                ok = r.status == "ok" and _same_cached_bytes(src, r)
                runs["warm"].append((took, ideal, cw.throttled, r.retries, ok))
                got, took_l = phase(
                    "loader start-up + epoch, SlowDown",
                    lambda k=k: _epoch(
                        url, loader_kw, storage_options=opts, cache_dir=os.path.join(work, f"c-slow-l{k}")
                    ),
                )
                cl = proxy.counts()
                ideal = max(max(cl.forwarded - a.burst, 0) / a.rate, epoch_cold_s)
                runs["epoch"].append((took_l, ideal, cl.throttled, "-", got == want))
                if k == 0:
                    print(_header())
                    print("\n".join(rows))
            print()
            print(f"{'run':<36} {'seconds':>8} {'ideal':>7} {'ratio':>6} {'503s':>5} {'cache retries':>13}  result")
            for side, label in (("warm", "warm, one node"), ("epoch", "loader epoch, fetch on miss")):
                for t, ideal, throttled, retries, ok in runs[side]:
                    verdict = "same bytes/batches" if ok else "DIFFERENT"
                    print(
                        f"{label:<36} {t:>8.2f} {ideal:>7.2f} {t / ideal:>6.2f} {throttled:>5} {retries!s:>13}  {verdict}"
                    )
                ratios = [t / ideal for t, ideal, *_ in runs[side]]
                if len(ratios) > 1:
                    print(
                        f"{label + ', median':<36} {'':>8} {'':>7} {statistics.median(ratios):>6.2f}  "
                        f"[{min(ratios):.2f}-{max(ratios):.2f}] over {len(ratios)} runs (target <= 1.5)"
                    )
            print(
                f"\nideal: the answered requests ({cw.forwarded} warm, {cl.forwarded} epoch, the last run) at "
                f"{a.rate:g}/s after the burst, or the unthrottled run where that is longer"
            )
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
