"""One rank of a gloo job reading a packed dataset with ShardedLoader over a data layout (tests/e2e/test_mesh_ddp.py).

Two ways to start it:
  python mesh_worker.py JOBS.json     forks every rank of every job (tests/helpers/forkranks.py), one line
                                      of [returncode, seconds] per rank per job on stdout
  torchrun ... mesh_worker.py ARGS    one rank, as a training script

A rank builds a real ``torch.distributed.device_mesh.init_device_mesh("cpu", shape,
mesh_dim_names=names)`` from --mesh (e.g. dp=2,tp=2) and hands it to the loader as ``mesh=``
with ``dp_dim``; without --mesh it is pure data parallelism. It iterates one epoch with one
all-reduce per step (what DDP does: a rank short of batches would hang there until the
collective timeout), and writes OUT/rank<r>.json: per batch its keys and a digest of every byte
of the collated batch, the batches it yields (batches_left), the remainder, its DP rank, and
state_dict() after the first batch and at the end. With --stop-at K it also writes OUT/state-rank<r>.json after K batches and
stops, as a job killed at step K after its checkpoint; --resume STATE continues from such a file.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist

from shardtool.loader import ShardedLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the helpers package
from helpers.forkranks import run_jobs_file  # noqa: E402


def digest(batch: dict) -> str:
    """sha256 over every field of a collated batch: names, dtypes, shapes and bytes."""
    h = hashlib.sha256()
    for name in sorted(batch):
        value = batch[name]
        h.update(name.encode())
        if isinstance(value, torch.Tensor):
            h.update(f"{value.dtype}{tuple(value.shape)}".encode())
            h.update(value.contiguous().numpy().tobytes())
        else:
            h.update(json.dumps(value, sort_keys=True, default=str).encode())
    return h.hexdigest()


def _write(out: str, name: str, record: dict) -> None:
    tmp = os.path.join(out, f".{name}.tmp")
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, os.path.join(out, name))


def rank_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--cache-dir", default=None, help="a node cache; {node} is replaced by this rank's node")
    p.add_argument("--mesh", default=None, help="mesh shape and names, row-major, e.g. dp=2,tp=2")
    p.add_argument("--dp-dim", default="dp")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--num-workers", type=int, default=1)
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--stop-at", type=int, default=None)
    p.add_argument("--resume", default=None)
    p.add_argument("--pg-timeout", type=float, default=60.0)
    args = p.parse_args(argv)

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank = dist.get_rank()
    mesh = None
    if args.mesh:
        from torch.distributed.device_mesh import init_device_mesh

        dims = [item.split("=") for item in args.mesh.split(",")]
        mesh = init_device_mesh("cpu", tuple(int(s) for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    cache_dir = args.cache_dir.format(node=rank // local) if args.cache_dir else None
    dp_dim = tuple(args.dp_dim.split(",")) if "," in args.dp_dim else args.dp_dim
    loader = ShardedLoader(
        args.data,
        batch_size=args.batch_size,
        seed=args.seed,
        num_workers=args.num_workers,
        mesh=mesh,
        dp_dim=dp_dim,
        cache_dir=cache_dir,
        pin_memory=False,
        timeout=60,
    )
    if args.resume:
        with open(args.resume) as f:
            loader.load_state_dict(json.load(f))
    record = {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "dp_rank": loader.dp_rank,
        "dp_size": loader.data_layout.dp_size,
        "epoch": loader.epoch,
        "len": loader.batches_left,  # this run's batches: the epoch's rest after a resume
        "remainder": loader.remainder.tolist(),
        "keys": [],
        "digests": [],
        "states": [],
    }
    for batch in loader:
        t = torch.tensor([1])
        dist.all_reduce(t)  # every rank must reach every step
        record["keys"].append(list(batch["__key__"]))
        record["digests"].append(digest(batch))
        if len(record["keys"]) == 1:
            record["states"].append(loader.state_dict())
        if len(record["keys"]) == args.stop_at:
            _write(args.out, f"state-rank{rank}.json", loader.state_dict())
            break
    record["states"].append(loader.state_dict())
    counts = torch.tensor([len(record["keys"]), -len(record["keys"])])
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    record["count_range"] = [-int(counts[1]), int(counts[0])]
    _write(args.out, f"rank{rank}.json", record)
    loader.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main() -> int:
    if "RANK" in os.environ:  # under torchrun
        p = argparse.ArgumentParser()
        p.add_argument("--out", required=True)
        known, rest = p.parse_known_args()
        os.makedirs(known.out, exist_ok=True)
        return rank_main(["--out", known.out, *rest])
    return run_jobs_file(sys.argv[1], rank_main)


if __name__ == "__main__":
    sys.exit(main())
