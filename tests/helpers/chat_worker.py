"""One rank of a torchrun job over packed chat data (tests/pack/test_pack_chat.py).

``--phase first``: a whole epoch of packed rows, a collective every step as DDP's, each step's
pieces and trained targets written out, the loader state saved after step ``--save-at``.
``--phase resumed``: that state loaded and the rest of the epoch served."""

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
    p.add_argument("--save-at", type=int, default=7)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loader = ShardedLoader(args.data, seq_len=1024, batch_size=2, seed=3, num_workers=2, pin_memory=False)
    state_path = os.path.join(args.out, "state.json")
    start = 0
    if args.phase == "resumed":
        with open(state_path) as f:
            loader.load_state_dict(json.load(f))
        start = args.save_at
    steps = []
    for step, batch in enumerate(loader, start=start):
        trained = batch["labels"] != -100
        steps.append(
            {
                "keys": batch["__key__"],
                "mask": int(batch["loss_mask"].sum()),
                "targets": batch["labels"][trained].tolist(),
            }
        )
        dist.all_reduce(torch.zeros(1))
        if args.phase == "first" and step + 1 == args.save_at and rank == 0:
            with open(state_path, "w") as f:
                json.dump(loader.state_dict(), f)
    with open(os.path.join(args.out, f"{args.phase}.rank{rank}.json"), "w") as f:
        json.dump({"start": start, "steps": steps}, f)
    loader.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
