"""One rank of a torchrun job reading a packed dataset with ShardedLoader (run by tests/e2e/test_ddp.py).

Records every batch's keys per epoch into OUT/rank<r>.json. With --stop-at K it saves the
loader's state after K batches to OUT/state-rank<r>.json and exits, as a job killed at step K
would after its last checkpoint; --resume STATE continues from such a file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from shardtool.loader import ShardedLoader


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--stop-at", type=int, default=None)
    p.add_argument("--resume", default=None)
    p.add_argument("--fail-key", default=None)
    p.add_argument("--cost-model", default=None, help="balance each step's compute (issue 33)")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    transform = None
    if args.fail_key:

        def transform(sample, bad=args.fail_key):
            if sample["__key__"] == bad:
                raise ValueError(f"injected failure on {bad}")
            return sample

    loader = ShardedLoader(
        args.data,
        batch_size=args.batch_size,
        num_workers=args.num_workers,
        seed=1,
        transform=transform,
        pin_memory=False,
        cost_model=args.cost_model,
    )
    start_epoch = 0
    if args.resume:
        with open(args.resume) as f:
            state = json.load(f)
        loader.load_state_dict(state)
        start_epoch = state["epoch"]
    record = {"rank": rank, "world_size": dist.get_world_size(), "epochs": {}}
    step = 0
    for epoch in range(start_epoch, args.epochs):
        loader.set_epoch(epoch)
        rec = record["epochs"].setdefault(
            str(epoch), {"len": len(loader), "remainder": loader.remainder.tolist(), "batches": []}
        )
        for batch in loader:
            t = torch.tensor([len(batch["__key__"])])
            dist.all_reduce(t)  # what DDP does every step: a rank short of batches would hang here
            rec["batches"].append(batch["__key__"])
            step += 1
            if step == args.stop_at:
                with open(os.path.join(args.out, f"state-rank{rank}.json"), "w") as f:
                    json.dump(loader.state_dict(), f)
                _write(args.out, rank, record)
                dist.barrier()
                dist.destroy_process_group()
                return 0
    _write(args.out, rank, record)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _write(out: str, rank: int, record: dict) -> None:
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    sys.exit(main())
