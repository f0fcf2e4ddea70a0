"""One rank of a torchrun job evaluating exactly (tests/loader/test_exact_eval.py): a per-sample
metric over ``ShardedLoader(exact=True)``'s valid samples, reduced across ranks by `ValidSum`.
Rank 0 writes the reduced (sum, count) and every rank its batch count and valid keys."""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from shardtool.loader import ShardedLoader, ValidSum


def sample_metric(batch: dict) -> torch.Tensor:
    """Per sample: its tokens' sum plus 1,000 per token plus 1 (a repeat would change it)."""
    tokens, lengths = batch["tokens"].long(), batch["lengths"]
    inside = torch.arange(tokens.shape[1])[None, :] < lengths[:, None]
    return (tokens * inside).sum(dim=1).double() + 1000.0 * lengths.double() + 1.0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--batch-size", type=int, default=8)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loader = ShardedLoader(
        args.data, batch_size=args.batch_size, exact=True, shuffle=False, num_workers=2, pin_memory=False
    )
    metric, keys, batches = ValidSum(), [], 0
    for batch in loader:
        metric.add(sample_metric(batch), batch["valid"])
        keys += [k for k, ok in zip(batch["__key__"], batch["valid"].tolist()) if ok]
        batches += 1
        dist.all_reduce(torch.zeros(1))  # a DDP step: a rank with fewer batches would hang here
    total, count = metric.reduce()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"len": len(loader), "batches": batches, "keys": keys, "sum": total, "count": count}, f)
    loader.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
