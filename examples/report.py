#!/usr/bin/env python
"""Report what a DDP run trained on, from examples/train_ddp.py's per-rank logs.

Checks the promises users rely on: every rank ran the same number of steps, no sample was
served twice in an epoch, and every sample was served except the plan's reported remainder.

    python examples/report.py DATASET LOG_DIR --nodes 2 --ranks-per-node 2 --max-tokens 8192
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys


def read_step_logs(log_dir: str) -> dict[int, dict[int, dict]]:
    """rank -> step -> the last entry logged for it (a resumed run rewrites the steps after its checkpoint)."""
    per_rank: dict[int, dict[int, dict]] = {}
    for path in sorted(glob.glob(os.path.join(log_dir, "keys.rank*.jsonl"))):
        rank = int(os.path.basename(path)[len("keys.rank") : -len(".jsonl")])
        steps: dict[int, dict] = {}
        with open(path) as f:
            for line in f:
                e = json.loads(line)
                steps[e["step"]] = e
        per_rank[rank] = steps
    return per_rank


def dataset_keys(ds) -> list[str]:
    """Every sample's key, indexed by global sample id."""
    return [k for s in range(ds.num_shards) for k in ds.shard_index(s).keys]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dataset")
    p.add_argument("log_dir")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--ranks-per-node", type=int, required=True)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--batch-size", type=int)
    g.add_argument("--max-tokens", type=int)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    from shardtool import open_dataset
    from shardtool.plan import Batching, DataLayout, Layout
    from shardtool.plan.simulate import epoch_remainder, simulate_epoch

    ds = open_dataset(args.dataset)
    keys = dataset_keys(ds)
    per_rank = read_step_logs(args.log_dir)
    if not per_rank:
        print(f"no logs in {args.log_dir}", file=sys.stderr)
        return 1
    layout = DataLayout.pure_dp(Layout(args.nodes, args.ranks_per_node))
    batching = Batching(batch_size=args.batch_size, max_tokens=args.max_tokens, seed=args.seed)
    sim = simulate_epoch(ds, layout, batching, 0)
    epoch0 = [k for steps in per_rank.values() for e in steps.values() if e["epoch"] == 0 for k in e["keys"]]
    remainder = {keys[i] for i in epoch_remainder(ds, layout, batching, 0).tolist()}
    print(f"ranks: {len(per_rank)}; steps per rank: {sorted({len(s) for s in per_rank.values()})}")
    print(
        f"epoch 0: {len(epoch0)} samples served, {len(set(epoch0))} distinct, dataset {len(keys)}, "
        f"remainder {len(remainder)} ({len(remainder) / len(keys):.2%}), padding efficiency "
        f"{sim.padding_efficiency:.3f}"
    )
    ok = len({len(s) for s in per_rank.values()}) == 1
    ok &= len(epoch0) == len(set(epoch0)) and set(epoch0) == set(keys) - remainder
    losses = [e["loss"] for e in per_rank[0].values()]
    print(f"rank 0 loss: first {losses[0]:.3f}, last {losses[-1]:.3f}")
    print("checks: " + ("equal steps, exactly once, remainder as planned: OK" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
