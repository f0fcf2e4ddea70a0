"""One rank of a torchrun job reading a mixture (run by tests/e2e/test_mixture_ddp.py).

Records every batch's source and keys into OUT/rank<r>.json. ``--ranks-per-node`` simulates nodes
on one machine; each simulated node reads through its own cache, CACHE_BASE/node<n>/cache. With
``--stop-at K`` it saves the state after step K to OUT/state-rank<r>.json and stops, as a job
killed after its checkpoint at K; ``--resume STATE`` continues from such a file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from shardtool.loader import Mixture, ShardedLoader


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mixture", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--ranks-per-node", type=int, required=True)
    p.add_argument("--cache-base", default=None)
    p.add_argument("--num-workers", type=int, default=1)
    p.add_argument("--stop-at", type=int, default=None, help="save the state after this step and exit")
    p.add_argument("--resume", default=None, help="a state saved by --stop-at")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    node = rank // args.ranks_per_node
    cache = os.path.join(args.cache_base, f"node{node}", "cache") if args.cache_base else None
    loader = ShardedLoader(
        Mixture.from_file(args.mixture),
        steps=args.steps,
        max_tokens=args.max_tokens,
        seed=2,
        ranks_per_node=args.ranks_per_node,
        num_workers=args.num_workers,
        cache_dir=cache,
        pin_memory=False,
    )
    if args.resume:
        with open(args.resume) as f:
            loader.load_state_dict(json.load(f))
    batches = []
    for batch in loader:
        t = torch.tensor([len(batch["__key__"])])
        dist.all_reduce(t)  # what DDP does every step: a rank short of batches would hang here
        batches.append([batch["__source__"], list(batch["__key__"])])
        if loader.step == args.stop_at:
            with open(os.path.join(args.out, f"state-rank{rank}.json"), "w") as f:
                json.dump(loader.state_dict(), f)
            break
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "batches": batches, "report": loader.report()}, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
