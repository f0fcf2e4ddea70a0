"""In-job staging vs a prolog-warmed cache vs fetch-on-miss alone (issue 22). Not a timed test.

A source with ``--latency`` seconds per request and a ``--bandwidth`` cap shared by every process
reading it (tests/helpers/faultfs.py, as benchmarks/warm_throughput.py simulates latency), 2 nodes x 2
ranks simulated here (4 gloo ranks forked from one process, one cache directory per node, 2
DataLoader workers each), a ``--step-ms`` training step. Three set-ups, each from cold caches:

- ``in-job``: ``ShardedLoader(stage=True)``: local rank 0 of each node stages its node's shards;
- ``prolog``: ``shardtool warm`` filled each node's cache before the job (not timed: the prolog's);
- ``fetch-on-miss``: the loader fetches each shard when a batch first needs it, nothing else.

Prints, per set-up, the median over ``--repeat`` alternating runs (with min..max) of the time to
the first batch (from the start of the rank's loader to its first batch, slowest rank) and of the
data-wait fraction after the first ``--skip`` steps (time in next() over the wall time from step
``--skip`` on, slowest rank). Targets: in-job first batch <= 2x prolog's; in-job wait <= 5%.

    python -m benchmarks.staging [--repeat 3] [--shards 512] [--shard-kb 256] [--latency 0.05]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(REPO, "tests")
sys.path.insert(0, REPO)
sys.path.insert(0, TESTS)

from helpers.cachedata import child_env, make_dataset  # noqa: E402  (tests/ on sys.path above)
from shardtool.cache import warm  # noqa: E402
from shardtool.plan import Layout, Placement  # noqa: E402

MODES = ("in-job", "prolog", "fetch-on-miss")
NODES, RANKS_PER_NODE = 2, 2


def job(a, work: str, mode: str, rep: int, options: dict) -> dict:
    out = os.path.join(work, f"out-{mode}-{rep}")
    cache = os.path.join(work, f"cache-{mode}-{rep}-{{node}}")
    argv = [
        "--data",
        "faulty://" + a.src,
        "--cache-dir",
        cache,
        "--options",
        json.dumps(options),
        "--batch-size",
        str(a.batch_size),
        "--steps",
        str(a.steps),
        "--step-s",
        str(a.step_ms / 1000),
        "--num-workers",
        "2",
        "--stage",
        "on" if mode == "in-job" else "off",
    ]
    env = {
        "LOCAL_WORLD_SIZE": str(RANKS_PER_NODE),
        "SHARDTOOL_STAGE_RUN": f"bench-{mode}-{rep}",
        "SHARDTOOL_STAGE_AHEAD": str(a.ahead),
        "SHARDTOOL_STAGE_JOBS": str(a.jobs),
    }
    return {"world": NODES * RANKS_PER_NODE, "out": out, "limit": 170, "argv": argv, "env": env, "mode": mode}


def measure(out: str, skip: int) -> tuple[float, float]:
    """(seconds to the first batch, data-wait fraction after ``skip`` steps), of the slowest rank."""
    recs = []
    for r in range(NODES * RANKS_PER_NODE):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            recs.append(json.load(f))
    first = max(r["first_batch_s"] for r in recs)
    fractions = []
    for r in recs:
        if len(r["waits"]) <= skip:
            raise SystemExit(f"{out}: rank {r['rank']} served {len(r['waits'])} batches, not more than --skip {skip}")
        fractions.append(sum(r["waits"][skip:]) / (r["end"] - r["asked"][skip]))
    return first, max(fractions)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=512, help="shards in the dataset (half per node)")
    ap.add_argument("--shard-kb", type=int, default=256)
    ap.add_argument("--samples", type=int, default=8, help="samples per shard")
    ap.add_argument("--batch-size", type=int, default=4, help="samples per batch per rank")
    ap.add_argument("--steps", type=int, default=60, help="training steps per run")
    ap.add_argument("--skip", type=int, default=20, help="the wait fraction counts the steps after these")
    ap.add_argument("--step-ms", type=float, default=50.0)
    ap.add_argument("--latency", type=float, default=0.05, help="seconds per source request")
    ap.add_argument("--bandwidth", default="100M", help="the source's bytes per second, shared by all readers")
    ap.add_argument("--ahead", type=int, default=64, help="shards the in-job stager keeps ahead of its slowest rank")
    ap.add_argument("--jobs", type=int, default=16, help="the in-job stager's concurrent fetches")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir, removed after)")
    a = ap.parse_args()
    from shardtool.format.sizes import parse_size

    work = a.dir or tempfile.mkdtemp(prefix="staging-bench-")
    os.makedirs(work, exist_ok=True)
    a.src = os.path.join(work, "src")
    if not os.path.exists(os.path.join(a.src, "index.json")):
        make_dataset(
            a.src, shards=a.shards, samples=a.samples, sample_bytes=a.shard_kb * 1000 // a.samples, replicate=True
        )
    options = {
        "latency": a.latency,
        "bandwidth": parse_size(a.bandwidth),
        "bandwidth_file": os.path.join(work, "source-pipe"),
    }
    print(
        f"dataset: {a.shards} shards x {a.shard_kb} kB; source: {a.latency * 1000:.0f} ms/request, "
        f"{a.bandwidth}B/s shared; {NODES} nodes x {RANKS_PER_NODE} ranks x 2 workers; step {a.step_ms:.0f} ms; "
        f"batch {a.batch_size} samples/rank; {a.steps} steps; stager --ahead {a.ahead} -j {a.jobs}",
        flush=True,
    )
    jobs = []
    for rep in range(a.repeat):  # alternating: load on the machine hits every set-up alike
        for mode in MODES:
            j = job(a, work, mode, rep, options)
            for node in range(NODES):
                cache = j["argv"][3].format(node=node)
                shutil.rmtree(cache, ignore_errors=True)
                if mode == "prolog":  # the prolog's warm, before the job (not timed)
                    r = warm(a.src, cache, placement=Placement(Layout(NODES, RANKS_PER_NODE), node), progress=False)
                    if r.status != "ok":
                        raise SystemExit(f"warm failed: {r.error}")
            jobs.append(j)
    path = os.path.join(work, "jobs.json")
    with open(path, "w") as f:
        json.dump(jobs, f)
    env = child_env()
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    began = time.monotonic()
    res = subprocess.run(
        [sys.executable, os.path.join(TESTS, "helpers", "stage_worker.py"), path],
        env=env,
        capture_output=True,
        text=True,
        timeout=175 * len(jobs),
        check=False,
    )
    if res.returncode:
        raise SystemExit(res.stderr[-3000:])
    results: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    for j, line in zip(jobs, map(json.loads, res.stdout.splitlines())):
        if any(rc != 0 for rc, _ in line["ranks"]):
            raise SystemExit(f"{j['out']}: ranks exited {line['ranks']}; see {j['out']}/rank*.log")
        results[j["mode"]].append(measure(j["out"], a.skip))
    print(f"{'set-up':<15} {'first batch s':>28} {'wait after step ' + str(a.skip):>30}")

    def cell(xs, fmt):
        return f"{fmt.format(statistics.median(xs))} [{fmt.format(min(xs))}..{fmt.format(max(xs))}]"

    med = {}
    for mode in MODES:
        firsts, waits = zip(*results[mode])
        med[mode] = statistics.median(firsts), statistics.median(waits)
        print(f"{mode:<15} {cell(firsts, '{:.3f}'):>28} {cell([w * 100 for w in waits], '{:.1f}%'):>30}")
    ratio = med["in-job"][0] / med["prolog"][0]
    print(
        f"first batch: in-job / prolog {ratio:.2f}x (target <= 2x), fetch-on-miss / prolog "
        f"{med['fetch-on-miss'][0] / med['prolog'][0]:.2f}x; wait after step {a.skip}: in-job "
        f"{med['in-job'][1] * 100:.1f}% (target <= 5%), fetch-on-miss {med['fetch-on-miss'][1] * 100:.1f}% "
        f"(medians of {a.repeat}; {time.monotonic() - began:.0f}s of runs)"
    )
    if not a.dir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
