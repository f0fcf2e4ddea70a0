"""One rank of a torchrun job that skips steps after a roll-back (tests/loader/test_loader_skip_steps.py).

``--phase first``: a whole epoch, a collective every step as DDP's, the keys of every step
written out and the loader state saved after step ``--save-at``. ``--phase resumed``: that state
loaded, steps ``--skip A:B`` skipped (``loader.skip_steps``), the rest of the epoch served."""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from shardtool.loader import ShardedLoader


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--phase", choices=["first", "resumed"], required=True)
    p.add_argument("--save-at", type=int, default=30)
    p.add_argument("--skip", default="35:40")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loader = ShardedLoader(args.data, batch_size=2, seed=5, num_workers=2, pin_memory=False)
    state_path = os.path.join(args.out, "state.json")
    start = 0
    if args.phase == "resumed":
        with open(state_path) as f:
            loader.load_state_dict(json.load(f))
        first, stop = (int(v) for v in args.skip.split(":"))
        loader.skip_steps(first, stop)
        start = args.save_at
    steps, length = {}, len(loader)  # the epoch's steps (read after it ends, the next epoch's)
    for step, batch in enumerate(loader, start=start):
        steps[step] = list(batch["__key__"])
        dist.all_reduce(torch.zeros(1))  # a DDP step: a rank that skipped differently would hang here
        if args.phase == "first" and step + 1 == args.save_at and rank == 0:
            with open(state_path, "w") as f:
                json.dump(loader.state_dict(), f)
    with open(os.path.join(args.out, f"{args.phase}.rank{rank}.json"), "w") as f:
        json.dump({"len": length, "steps": steps}, f)
    loader.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
