"""One rank of a torchrun job whose loader logs metrics and a cross-rank summary (tests/e2e/test_ddp_metrics.py).

Two simulated nodes of two ranks each (ranks_per_node=2). Rank --slow-rank reads the same
dataset through a slow fsspec source (tests/helpers/faultfs.py: every request waits --latency s), the
others read it in place; after every batch the ranks all-reduce, as DDP does, so the fast
ranks wait for the slow one in the collective and the slow one waits for its data.
"""

from __future__ import annotations

import argparse
import json
import logging
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
    p.add_argument("--out", required=True)
    p.add_argument("--slow-rank", type=int, default=2)
    p.add_argument("--latency", type=float, default=0.03)
    p.add_argument("--every", type=int, default=5)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    slow = rank == args.slow_rank
    url = ("faulty://" + args.data) if slow else args.data
    loader = ShardedLoader(
        url,
        batch_size=4,
        seed=1,
        num_workers=0,
        ranks_per_node=2,
        pin_memory=False,
        storage_options={"latency": args.latency} if slow else None,
        metrics_every=args.every,
        metrics_dir=os.path.join(args.out, "metrics", f"node{rank // 2}"),
        metrics_reduce=True,
    )
    for batch in loader:
        t = torch.tensor([len(batch["__key__"])])
        dist.all_reduce(t)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"summary": loader.rank_summary, "metrics": loader.metrics(), "path": loader.metrics_path}, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
