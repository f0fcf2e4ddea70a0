"""Reading a remote dataset with no local disk against reading it from a warmed node cache
(issue 38 item 3), at a simulated training step, behind a store that answers slowly.

Packs real text (stdlib source files as byte-id tokens, plain Arrow shards), uploads it to a moto
server on 127.0.0.1 behind the proxy of tests/helpers/s3proxy.py, which adds ``--latency`` seconds to
every answer and sends each answer's body at ``--bandwidth`` MB/s (the issue's store: 50 ms a request,
100 MB/s). The proxy runs in a process of its own, as a store does (``--proxy-in-process``: in the
benchmark's, where its threads take the loader's interpreter lock, as before 2026-12-08). Each side runs one epoch of a 1-rank loader (``--workers`` workers) whose trainer
sleeps ``--step`` seconds a batch, and reports the time the trainer waited for data
(``metrics()['cumulative']['wait_s']``): the warmed side reads a node cache `shardtool warm`
filled first (not timed); the empty-cache side a new node cache each round, which fetches the
shards on a miss (ahead of the read, loader/cachefill.py); the diskless side reads the store
directly (``cache_dir=None``; the record batches it fetches are kept in memory,
loader/batchcache.py). Sides alternate, ``--rounds``
times; medians and ranges are printed, and the ratio of the medians (target: diskless within 1.5x).

    python benchmarks/diskless.py [--files 600] [--latency 0.05] [--bandwidth 100] [--step 0.05] [--rounds 3]

From a checkout only (it needs tests/ and moto). Run it on a quiet machine: it times waits.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))

from helpers.s3proxy import Faults, S3Proxy, stdlib_dataset  # noqa: E402
from helpers.s3server import S3Server  # noqa: E402


def _serve(conn, endpoint: str, faults: Faults) -> None:
    with S3Proxy(endpoint, faults) as proxy:
        conn.send(proxy.storage_options)
        conn.recv()  # until told to stop


@contextlib.contextmanager
def _proxy(endpoint: str, faults: Faults, in_process: bool):
    """The store's storage options: the proxy in its own process, or in this one."""
    if in_process:
        with S3Proxy(endpoint, faults) as proxy:
            yield proxy.storage_options
        return
    mine, theirs = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_serve, args=(theirs, endpoint, faults), daemon=True)
    proc.start()
    try:
        yield mine.recv()
    finally:
        mine.send(None)
        proc.join(10)


def _epoch(url, opts, *, cache_dir, step: float, **kw) -> tuple[float, float, list]:
    """(the epoch's data wait, the first batch's part of it, the keys served)."""
    from shardtool.loader import ShardedLoader

    ld = ShardedLoader(url, storage_options=opts, cache_dir=cache_dir, **kw)
    keys: list = []
    first = 0.0
    for batch in ld:
        if not keys:  # the pass's start: its plan, metadata reads, workers' start and first batch
            first = ld.metrics()["cumulative"]["wait_s"]
        keys += list(batch["__key__"])
        time.sleep(step)  # the trainer's step: the workers read ahead meanwhile
    wait = ld.metrics()["cumulative"]["wait_s"]
    ld.close()
    return wait, first, keys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=600, help="stdlib files packed (default 600)")
    ap.add_argument("--latency", type=float, default=0.05, help="seconds added to every answer (default 0.05)")
    ap.add_argument("--bandwidth", type=float, default=100, help="MB/s an answer is sent at (default 100; 0: no limit)")
    ap.add_argument("--proxy-in-process", action="store_true", help="run the store's proxy in this process")
    ap.add_argument("--step", type=float, default=0.05, help="the trainer's seconds per batch (default 0.05)")
    ap.add_argument("--batch-size", type=int, default=8, help="samples per batch (default 8)")
    ap.add_argument("--workers", type=int, default=2, help="loader workers (default 2)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of both sides (default 3)")
    a = ap.parse_args(argv)

    from shardtool.cache import warm
    from shardtool.format import open_dataset

    work = tempfile.mkdtemp(prefix="diskless-")
    src = stdlib_dataset(os.path.join(work, "ds"), files=a.files)
    m = open_dataset(src).manifest
    kw = dict(batch_size=a.batch_size, num_workers=a.workers, seed=0, rank=0, world_size=1, pin_memory=False)
    server = S3Server().start()
    try:
        url = server.upload(src, f"diskless{int(time.time())}/ds")
        print(
            f"{url}: {len(m.shards)} shards, {m.num_samples} samples, {sum(s.bytes for s in m.shards) / 1e6:.1f} MB; "
            f"{a.latency * 1e3:.0f} ms a request, {a.bandwidth:g} MB/s, a step of {a.step * 1e3:.0f} ms, "
            f"{a.workers} workers, proxy in {'this' if a.proxy_in_process else 'its own'} process"
        )
        faults = Faults(latency=a.latency, bandwidth=a.bandwidth * 1e6 if a.bandwidth > 0 else None)
        with _proxy(server.endpoint, faults, a.proxy_in_process) as opts:
            cache = os.path.join(work, "cache")
            report = warm(url, cache, storage_options=opts, jobs=8, progress=False)
            assert report.status == "ok", report.summary()
            sides = ("warmed cache", "empty cache", "diskless")
            waits: dict[str, list[float]] = {side: [] for side in sides}
            firsts: dict[str, list[float]] = {side: [] for side in sides}
            keys = {}
            for r in range(a.rounds):
                for side in sides:
                    # "empty cache": a node cache nobody warmed, fetching each shard on its first read
                    cache_dir = {"warmed cache": cache, "empty cache": os.path.join(work, f"empty{r}")}.get(side)
                    wait, first, got = _epoch(url, opts, cache_dir=cache_dir, step=a.step, **kw)
                    waits[side].append(wait)
                    firsts[side].append(first)
                    keys[side] = got
            assert keys["warmed cache"] == keys["diskless"] == keys["empty cache"], "the sides served different batches"
    finally:
        server.stop()
    steps = -(-m.num_samples // a.batch_size)
    for side, w in waits.items():
        f = firsts[side]
        rest = [a - b for a, b in zip(w, f)]
        print(
            f"{side:<13} data wait {statistics.median(w):6.2f} s an epoch of ~{steps} steps [{min(w):.2f}-{max(w):.2f}]: "
            f"first batch {statistics.median(f):.2f} s [{min(f):.2f}-{max(f):.2f}], "
            f"the other steps {statistics.median(rest):.2f} s [{min(rest):.2f}-{max(rest):.2f}]"
        )
    warmed = max(statistics.median(waits["warmed cache"]), 1e-3)
    print(f"diskless / warmed: {statistics.median(waits['diskless']) / warmed:.2f}x the data wait (target <= 1.5x)")
    print(f"empty cache / warmed: {statistics.median(waits['empty cache']) / warmed:.2f}x the data wait")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
