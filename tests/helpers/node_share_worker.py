"""One rank of a torchrun job reading a remote dataset (tests/cache/test_node_share.py): opens
the loader on the s3:// URL with the proxy's storage options (JSON in ``--options``), serves the
epoch with a collective every step, and writes the keys it served."""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from shardtool.loader import ShardedLoader


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--options", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--cache-dir", default=None)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loader = ShardedLoader(
        args.url,
        batch_size=4,
        seed=1,
        num_workers=0,
        pin_memory=False,
        storage_options=json.loads(args.options),
        cache_dir=args.cache_dir,
    )
    keys = []
    for batch in loader:
        keys += list(batch["__key__"])
        dist.all_reduce(torch.zeros(1))
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(keys, f)
    loader.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
