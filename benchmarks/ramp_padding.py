"""Padding of a bucketed batch-size ramp: the ramp's steps of each size against a loader of that
size alone, and against the same planned batches joined without runs of like lengths.

Real documents made on this machine (stdlib .py files and /usr/share/doc text as byte ids, heavy
tailed), packed once; for each seed, one epoch of ``ShardedLoader(batch_size=RAMP)`` on one rank,
one of ``batch_size=BASE`` whose batches are joined by the same schedule (what a ramp without
runs would serve), and one epoch of each size alone. Real tokens / padded tokens of the steps of
each size, pooled over the seeds. No timing: the result does not depend on machine load.

    python -m shardtool.benchmarks.ramp_padding                  # 0:8, 100:16, 250:32; five seeds
    python -m shardtool.benchmarks.ramp_padding --schedule 0:4,50:8 --seeds 3
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np

from shardtool import pack
from shardtool.loader import ShardedLoader
from shardtool.plan.schedule import Schedule, parse_schedule_text

from .realdocs import doc_files, stdlib_files


def _efficiency(lengths: list[np.ndarray]) -> float:
    real = sum(int(x.sum()) for x in lengths)
    padded = sum(int(x.max()) * len(x) for x in lengths)
    return real / padded if padded else 1.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedule", default="0:8,100:16,250:32", help="first step:size,... (default %(default)s)")
    p.add_argument("--seeds", type=int, default=5, help="epochs with seeds 1..N, pooled (default 5)")
    p.add_argument("--docs", type=int, default=2000, help="/usr/share/doc files besides the stdlib (default 2000)")
    args = p.parse_args(argv)
    schedule = parse_schedule_text(args.schedule)
    if not isinstance(schedule, Schedule):
        p.error("--schedule needs at least two sizes, e.g. 0:8,100:16")
    paths = stdlib_files() + [q for q in doc_files() if os.path.getsize(q) > 0][: args.docs]
    rows = [{"tokens": np.fromfile(q, dtype=np.uint8).astype(np.uint16)} for q in paths]
    sizes = sorted({size for _, size in schedule.changes})
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "docs")
        pack(rows, root, format="arrow", length="tokens", shard_size=64 << 20)
        print(f"{len(rows):,} documents; schedule {schedule.describe()}; base {schedule.base}; seeds 1..{args.seeds}")
        pooled: dict[int, dict[str, list]] = {s: {"ramp": [], "joined": [], "alone": []} for s in sizes}

        def epoch(size, seed) -> list[np.ndarray]:
            ld = ShardedLoader(root, batch_size=size, seed=seed, num_workers=0, pin_memory=False)
            out = [b["lengths"].numpy() for b in ld]
            ld.close()
            return out

        for seed in range(1, args.seeds + 1):
            ramp = epoch(dict(schedule.changes), seed)
            base = epoch(schedule.base, seed)
            cut = schedule.cut(0, len(base))
            joined = [np.concatenate(base[a:z]) for a, z in zip(cut[:-1].tolist(), cut[1:].tolist())]
            for size in sizes:
                pooled[size]["ramp"] += [x for x in ramp if len(x) == size]
                pooled[size]["joined"] += [x for x in joined if len(x) == size]
                pooled[size]["alone"] += epoch(size, seed)
    print(f"{'size':>6} {'ramp':>8} {'joined, no runs':>16} {'size alone':>11}   steps of the ramp")
    for size in sizes:
        got = pooled[size]
        print(
            f"{size:>6} {_efficiency(got['ramp']):>8.3f} {_efficiency(got['joined']):>16.3f} "
            f"{_efficiency(got['alone']):>11.3f}   {len(got['ramp']):,}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
