"""One rank of a 2-rank gloo job for in-job staging tests (tests/e2e/test_stage_ddp.py) and the staging
benchmark (benchmarks/staging.py).

  python stage_worker.py JOBS.json   forks every rank of every job (tests/helpers/forkranks.py), one line of
                                     [returncode, seconds] per rank per job on stdout

Every step all-reduces, as DDP does, then sleeps ``--step-s`` (the model's step). Writes
OUT/rank<r>.json: the keys of each batch, the seconds to the first batch (from before the loader
is made), the loader's wait for data per step, and its cache counters.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the helpers package
from helpers import faultfs  # noqa: F401  registers faulty://
from helpers.forkranks import run_jobs_file
from shardtool.loader import ShardedLoader


def rank_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--cache-dir", default=None, help="a node cache; {node} is replaced by this rank's node")
    p.add_argument("--stage", default="off", choices=["off", "on", "external"])
    p.add_argument("--options", default=None, help="storage options, JSON")
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=0, help="samples per batch instead of --max-tokens")
    p.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: the whole epoch)")
    p.add_argument("--step-s", type=float, default=0.0)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--pg-timeout", type=float, default=60.0)
    args = p.parse_args(argv)

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank = dist.get_rank()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    cache_dir = args.cache_dir.format(node=rank // local) if args.cache_dir else None
    stage = {"off": False, "on": True, "external": "external"}[args.stage]
    began = time.perf_counter()
    size = {"batch_size": args.batch_size} if args.batch_size else {"max_tokens": args.max_tokens}
    loader = ShardedLoader(
        args.data,
        **size,
        seed=0,
        num_workers=args.num_workers,
        cache_dir=cache_dir,
        storage_options=json.loads(args.options) if args.options else None,
        pin_memory=False,
        timeout=60,
        stage=stage,
        metrics_every=0,
    )
    record = {"rank": rank, "keys": [], "waits": [], "asked": [], "first_batch_s": None}
    it = iter(loader)
    while True:
        t = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        record["waits"].append(time.perf_counter() - t)
        record["asked"].append(t)
        if record["first_batch_s"] is None:
            record["first_batch_s"] = time.perf_counter() - began
        x = torch.tensor([1])
        dist.all_reduce(x)  # every rank must reach every step
        record["keys"].append(list(batch["__key__"]))
        if args.step_s:
            time.sleep(args.step_s)
        if len(record["keys"]) == args.steps:
            break
    record["end"] = time.perf_counter()
    record["cache"] = loader.metrics()["cumulative"].get("cache")
    loader.close()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(run_jobs_file(sys.argv[1], rank_main))
