"""One rank of a torchrun job reading through a node cache that starts empty (tests/cache/test_cache_cold.py).

Every step all-reduces the batch size, as DDP does, so a rank whose workers are stuck makes the
other wait and the job fail on the collective timeout instead of finishing. Writes the keys of
each batch to OUT/rank<r>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the helpers package
from helpers import faultfs  # noqa: E402,F401  registers faulty://
from shardtool.loader import ShardedLoader  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--latency", type=float, default=0.0, help="seconds per source request (faulty:// only)")
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--collective-timeout", type=float, default=20.0)
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.collective_timeout))
    rank = dist.get_rank()
    opts = {"latency": args.latency} if args.data.startswith("faulty://") else None
    loader = ShardedLoader(
        args.data,
        max_tokens=2048,
        seed=0,
        num_workers=args.num_workers,
        cache_dir=args.cache_dir,
        storage_options=opts,
        pin_memory=False,
    )
    keys = []
    for batch in loader:
        t = torch.tensor([len(batch["__key__"])])
        dist.all_reduce(t)
        keys.append(list(batch["__key__"]))
        if len(keys) == args.max_steps:
            break
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(keys, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
