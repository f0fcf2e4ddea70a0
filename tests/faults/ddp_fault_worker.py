"""Gloo jobs for tests/faults/test_ddp_faults.py: real rank processes, timed from outside.

`python ddp_fault_worker.py JOBS.json` forks every rank of every job itself (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT set per rank) and times each rank's exit; torchrun's agent would kill
the survivors of a failed rank for us and hide whether they fail on their own.

--cases FILE: a JSON list of cases run in sequence on one process group. Per case each rank
builds a ShardedLoader, iterates it with one all-reduce per step (what DDP does), then
all-reduces its batch count (min and max) to prove every rank finished the same number; it
writes OUT/rank<r>.json with, per case, its keys or the error planning raised.

--sabotage KIND:KEY (on the rank given by --sabotage-rank): the transform raises, hangs or
SIGKILLs its own process on sample KEY. Every rank writes OUT/rank<r>.json when it fails,
with the elapsed seconds and the error, then exits 1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import time
import traceback

import torch
import torch.distributed as dist

from shardtool.loader import ShardedLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the launcher
from helpers.forkranks import run_jobs_file  # noqa: E402


def _write(out: str, rank: int, record: dict) -> None:
    tmp = os.path.join(out, f".rank{rank}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, os.path.join(out, f"rank{rank}.json"))


def run_cases(cases: list[dict], rank: int, out: str) -> int:
    results = []
    for case in cases:
        res: dict = {"name": case["name"]}
        results.append(res)
        kw = {k: case[k] for k in ("batch_size", "max_tokens") if k in case}
        try:
            loader = ShardedLoader(
                case["data"],
                **kw,
                ranks_per_node=case["ranks_per_node"],
                num_workers=case["num_workers"],
                seed=case.get("seed", 0),
                pin_memory=False,
                timeout=30,
            )
            res["len"] = len(loader)  # plans the epoch: where a too-small dataset is refused
        except ValueError as e:
            res["error"] = str(e)
            continue  # the plan is a pure function: every rank refuses the same layout
        res["remainder"] = loader.remainder.tolist()
        res["batches"] = batches = []
        for batch in loader:
            t = torch.tensor([len(batch["__key__"])])
            dist.all_reduce(t)  # a rank short of batches would block here until the timeout
            batches.append(list(batch["__key__"]))
        t = torch.tensor([len(batches), -len(batches)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        res["count_range"] = [-int(t[1]), int(t[0])]
        loader.close()
    _write(out, rank, {"rank": rank, "cases": results})
    return 0


def sabotaged(kind: str, key: str):
    def transform(sample):
        if sample["__key__"] == key:
            if kind == "raise":
                raise ValueError(f"injected failure on {key}")
            if kind == "hang":
                time.sleep(3600)
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
        return sample

    return transform


def run_sabotage(args, rank: int) -> int:
    kind, key = args.sabotage.split(":", 1)
    transform = sabotaged(kind, key) if rank == args.sabotage_rank else None
    loader = ShardedLoader(
        args.data,
        batch_size=args.batch_size,
        num_workers=args.num_workers,
        seed=1,
        pin_memory=False,
        timeout=args.loader_timeout,
        transform=transform,
    )
    began = time.monotonic()
    steps = 0
    try:
        for batch in loader:
            t = torch.tensor([len(batch["__key__"])])
            dist.all_reduce(t)
            steps += 1
    except Exception as e:
        _write(
            args.out,
            rank,
            {
                "rank": rank,
                "steps": steps,
                "elapsed": time.monotonic() - began,
                "type": type(e).__name__,
                "error": "".join(traceback.format_exception(e)),
            },
        )
        raise
    _write(args.out, rank, {"rank": rank, "steps": steps, "elapsed": time.monotonic() - began, "error": None})
    return 0


def rank_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--pg-timeout", type=float, default=20.0)
    p.add_argument("--cases", default=None)
    p.add_argument("--data", default=None)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--loader-timeout", type=float, default=3.0)
    p.add_argument("--sabotage", default=None)
    p.add_argument("--sabotage-rank", type=int, default=1)
    args = p.parse_args(argv)

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank = dist.get_rank()
    if args.cases:
        with open(args.cases) as f:
            rc = run_cases(json.load(f), rank, args.out)
    else:
        rc = run_sabotage(args, rank)
    dist.barrier()
    dist.destroy_process_group()
    return rc


# ------------------------------------------------------------------------------ the launcher
def main() -> int:
    """Run the jobs in JOBS.json one after another; print one JSON line of results per job.

    torch is imported once here and every rank is forked from this process (tests/helpers/forkranks.py).
    """
    return run_jobs_file(sys.argv[1], rank_main)


if __name__ == "__main__":
    sys.exit(main())
