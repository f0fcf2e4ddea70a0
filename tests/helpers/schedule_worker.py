"""One rank of a torchrun job with a batch-size ramp (tests/loader/test_batch_schedule.py), with
``--warmup`` a sequence-length warmup of packed rows (tests/loader/test_seq_len_schedule.py), or
with ``--mixture`` (``--data`` a mixture file) a packed mixture whose rows ramp
(tests/loader/test_mixture_ramp.py), and with both a mixture's warmup (tests/loader/test_mixture_warmup.py).
``--cost-model NAME``: the steps balanced by that cost model (tests/loader/test_mixture_balance_loader.py).
``--budget``: a token-budget ramp, each step a list of micro-batches (tests/loader/test_budget_schedule.py).

``--phase whole``: the epoch uninterrupted, a collective every step as DDP's. ``--phase killed``:
the same, rank 0 saving the loader state after every step, and rank 1 killed with SIGKILL before
step ``--kill-at``. ``--phase resumed``: the last state saved, loaded, and the epoch served from
there. Every phase writes the keys of each step it served (packed: each row's keys, the pieces' offsets and the row length), by the run's step number."""

from __future__ import annotations

import argparse
import json
import os
import signal

import torch
import torch.distributed as dist

from shardtool.loader import ShardedLoader
from shardtool.plan.mixture import Mixture

RAMP = {0: 4, 10: 8}
WARMUP = {0: 256, 10: 512}  # rows of 4 at either length: the plan's batch is 2 rows of 512
BUDGET = {0: 4096, 10: 8192}  # one micro-batch a step, then two


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--phase", choices=["whole", "killed", "resumed"], required=True)
    p.add_argument("--kill-at", type=int, default=8)
    p.add_argument("--warmup", action="store_true")
    p.add_argument("--mixture", action="store_true")
    p.add_argument("--cost-model", default=None)
    p.add_argument("--budget", action="store_true")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    data: object = args.data
    if args.mixture:
        data = Mixture.from_file(args.data)
        kw: dict = dict(batch_size=RAMP, seq_len=256, token_fields=[], steps=20)
        if args.warmup:  # rows of 4 at either length, cut from the mixture's rows of 512
            kw.update(batch_size=4, seq_len=WARMUP)
    elif args.warmup:
        kw = dict(batch_size=4, seq_len=WARMUP, token_fields=[])
    elif args.budget:
        kw = dict(max_tokens=BUDGET)
    else:
        kw = dict(batch_size=RAMP)
    if args.cost_model:
        kw["cost_model"] = args.cost_model
    loader = ShardedLoader(data, seed=7, num_workers=2, pin_memory=False, **kw)
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
        if args.budget:  # a list of micro-batches: each all-reduced, as accumulated gradients would be
            steps[step] = [list(mb["__key__"]) for mb in batch]
            for _ in batch[1:]:
                dist.all_reduce(torch.zeros(1))
        else:
            steps[step] = list(batch["__key__"])
        if args.warmup or args.mixture:
            steps[step] = [[list(map(str, k)) for k in batch["__key__"]], batch["doc_offsets"].tolist()]
            steps[step].append(list(batch["input_ids"].shape))
        if args.mixture:
            steps[step].append(list(batch["__source__"]))
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
