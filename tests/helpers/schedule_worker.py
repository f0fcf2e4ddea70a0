"""One rank of a torchrun job with a batch-size ramp (tests/loader/test_batch_schedule.py).

``--phase whole``: the epoch uninterrupted, a collective every step as DDP's. ``--phase killed``:
the same, rank 0 saving the loader state after every step, and rank 1 killed with SIGKILL before
step ``--kill-at``. ``--phase resumed``: the last state saved, loaded, and the epoch served from
there. Every phase writes the keys of each step it served, by the run's step number."""

from __future__ import annotations

import argparse
import json
import os
import signal

import torch
import torch.distributed as dist

from shardtool.loader import ShardedLoader

RAMP = {0: 4, 10: 8}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--phase", choices=["whole", "killed", "resumed"], required=True)
    p.add_argument("--kill-at", type=int, default=8)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loader = ShardedLoader(args.data, batch_size=RAMP, seed=7, num_workers=2, pin_memory=False)
    state_path = os.path.join(args.out, "state.json")
    start = 0
    if args.phase == "resumed":
        with open(state_path) as f:
            saved = json.load(f)
        loader.load_state_dict(saved["state"])
        start = saved["steps"]
    steps, length = {}, len(loader)
    for step, batch in enumerate(loader, start=start):
        if args.phase == "killed" and rank == 1 and step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        steps[step] = list(batch["__key__"])
        dist.all_reduce(torch.zeros(1))  # a DDP step: a rank on another step would hang here
        if args.phase == "killed" and rank == 0:
            tmp = state_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"steps": step + 1, "state": loader.state_dict()}, f)
            os.replace(tmp, state_path)
    with open(os.path.join(args.out, f"{args.phase}.rank{rank}.json"), "w") as f:
        json.dump({"len": length, "steps": steps}, f)
    loader.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
