"""One task per node of a SLURM job: every rank of this node reads its whole epoch through the node's
cache, as a training job would, and records what it read and what it had to fetch (0: staged).

    stage_reader.py URL OUTDIR [--mesh pp=2,dp=2] [--ranks-per-node 2] [--wait FLAG]

Writes OUTDIR/<node>.pass1.json; with --wait, waits for FLAG, reads the epoch again, writes pass2.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from shardtool.loader import ShardedLoader
from shardtool.plan import parse_mesh


def read_epoch(args, node: int, nodes: int, cache_dir: str) -> dict:
    out = {"batches": 0, "samples": 0, "fetched_bytes": 0}
    for local in range(args.ranks_per_node):
        loader = ShardedLoader(
            args.url,
            batch_size=2,
            shuffle=False,
            rank=node * args.ranks_per_node + local,
            world_size=nodes * args.ranks_per_node,
            ranks_per_node=args.ranks_per_node,
            mesh=parse_mesh(args.mesh) if args.mesh else None,
            num_workers=0,
            cache_dir=cache_dir,
            metrics=False,
        )
        for batch in loader:
            out["batches"] += 1
            out["samples"] += len(batch["__key__"]) if "__key__" in batch else 0
        out["fetched_bytes"] += loader.reader.source.fetched_bytes
        loader.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("outdir")
    p.add_argument("--mesh")
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--wait")
    args = p.parse_args()
    node, nodes = int(os.environ["SLURM_NODEID"]), int(os.environ["SLURM_JOB_NUM_NODES"])
    name = os.environ["SLURMD_NODENAME"]
    cache_dir = os.path.join(os.environ["CACHE_ROOT"], name)
    passes = [("pass1", None), ("pass2", args.wait)] if args.wait else [("pass1", None)]
    for tag, flag in passes:
        if flag:
            deadline = time.monotonic() + 120
            while not os.path.exists(flag) and time.monotonic() < deadline:
                time.sleep(0.2)
        result = read_epoch(args, node, nodes, cache_dir)
        with open(os.path.join(args.outdir, f"{name}.{tag}.json"), "w") as f:
            json.dump(result, f)
        print(f"{name} {tag}: {result}", flush=True)


if __name__ == "__main__":
    main()
