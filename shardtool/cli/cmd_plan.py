"""``shardtool plan``: what every node and rank of a layout would read, from metadata only."""
from __future__ import annotations

import json
import time

from ..format.sizes import format_size

HELP = "show the loading plan of a layout: batches per rank, padding, bytes and shards per node"
DESCRIPTION = """\
Plan one epoch of a dataset for a node layout, reading only its manifest and lengths file
(no shard is opened), and print: batches per rank (equal on every rank), padding efficiency,
the remainder (samples no rank serves this epoch; they rotate across epochs), bytes and shards
each node must hold in its cache, and the planning time.

Layouts far beyond this machine are fine: --simulate-nodes 1024 --ranks-per-node 8 only plans.
Without a dataset, --synthetic N plans N lognormal lengths (median 350, the benchmarks' corpus) in
shards of 10,000.

examples:
  shardtool plan s3://bucket/ds --nodes 4 --ranks-per-node 8 --max-tokens 65536
  shardtool plan ./ds --simulate-nodes 1024 --ranks-per-node 8 --batch-size 32 --json
  shardtool plan --synthetic 100000000 --simulate-nodes 1024 --ranks-per-node 8 --max-tokens 65536
"""


def add_arguments(p) -> None:
    p.add_argument("url", nargs="?", help="dataset root (local path or fsspec URL)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--nodes", type=int, default=None, help="number of nodes (default 1)")
    where.add_argument("--simulate-nodes", type=int, default=None, metavar="N",
                       help="same as --nodes; says that the layout is only planned, never run")
    p.add_argument("--ranks-per-node", type=int, default=1, metavar="G", help="ranks (GPUs) per node (default 1)")
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--batch-size", type=int, help="samples per batch")
    size.add_argument("--max-tokens", type=int, help="token budget per batch, padding counted")
    p.add_argument("--seed", type=int, default=0, help="shuffle seed, as given to ShardedLoader (default 0)")
    p.add_argument("--epoch", type=int, default=0, help="which epoch to plan (default 0); the order and the "
                   "remainder change every epoch, node ranges never do")
    p.add_argument("--no-shuffle", action="store_true", help="plan without shuffling")
    p.add_argument("--synthetic", type=int, default=None, metavar="N",
                   help="plan N synthetic lognormal lengths instead of a dataset")
    p.add_argument("--json", action="store_true", help="print one JSON object (with per-node lists)")


def _metadata(args):
    import numpy as np

    from ..format import open_dataset

    if args.synthetic is not None:
        from ..plan.synthetic import MAX_LENGTH, lognormal_lengths

        lengths = lognormal_lengths(args.synthetic, high=min(args.max_tokens or MAX_LENGTH, MAX_LENGTH))
        counts = np.full(-(-args.synthetic // 10_000), 10_000, dtype=np.int64)
        counts[-1] = args.synthetic - 10_000 * (len(counts) - 1)
        shard_bytes = counts * 4 * 350  # ~4 bytes per token
        return f"synthetic:{args.synthetic}", lengths, counts, shard_bytes
    ds = open_dataset(args.url)
    shard_bytes = np.array([s.bytes for s in ds.manifest.shards], dtype=np.int64)
    return args.url, ds.lengths, ds.shard_counts, shard_bytes


def _summary(values) -> dict:
    import numpy as np

    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return {"min": 0, "mean": 0, "max": 0}
    return {"min": float(v.min()), "mean": float(v.mean()), "max": float(v.max())}


def run(args) -> int:
    import numpy as np

    from ..plan import Batching, Layout, node_shard_ranges, plan_epoch

    from ..format import ShardtoolError

    if args.url is None and args.synthetic is None:
        raise ShardtoolError("give a dataset URL or --synthetic N")
    nodes = args.simulate_nodes or args.nodes or 1
    try:
        layout = Layout(nodes, args.ranks_per_node)
        batching = Batching(batch_size=args.batch_size, max_tokens=args.max_tokens,
                            shuffle=not args.no_shuffle, seed=args.seed)
    except ValueError as e:
        raise ShardtoolError(str(e)) from None
    source, lengths, counts, shard_bytes = _metadata(args)
    began = time.perf_counter()
    try:
        plan = plan_epoch(lengths, counts, layout, batching, args.epoch)
    except ValueError as e:
        raise ShardtoolError(str(e)) from None
    plan_s = time.perf_counter() - began
    began = time.perf_counter()
    pieces = node_shard_ranges(lengths, counts, nodes)
    nodes_s = time.perf_counter() - began
    node_shards = [len(p) for p in pieces]
    node_bytes = [int(sum(int(shard_bytes[s]) for s, _, _ in p)) for p in pieces]
    node_samples = [int(sum(b - a for _, a, b in p)) for p in pieces]
    shared = sum(1 for p in pieces for s, a, b in p if b - a < counts[s])
    per_rank = np.diff(plan.batch_offsets).reshape(layout.world_size, plan.batches_per_rank) \
        if plan.batches_per_rank else np.zeros((layout.world_size, 0), np.int64)
    report = {
        "source": source,
        "layout": {"nodes": nodes, "ranks_per_node": layout.ranks_per_node, "world_size": layout.world_size},
        "batching": {"batch_size": args.batch_size, "max_tokens": args.max_tokens, "seed": args.seed,
                     "epoch": args.epoch, "shuffle": not args.no_shuffle},
        "samples": int(len(lengths)),
        "shards": int(len(counts)),
        "batches_per_rank": plan.batches_per_rank,
        "samples_per_rank": _summary(per_rank.sum(axis=1)),
        "padding_efficiency": plan.padding_efficiency,
        "remainder": int(plan.remainder.size),
        "shards_per_node": _summary(node_shards),
        "bytes_per_node": _summary(node_bytes),
        "samples_per_node": _summary(node_samples),
        "split_shard_pieces": shared,
        "planning_seconds": plan_s,
        "node_assignment_seconds": nodes_s,
    }
    if args.json:
        report["per_node"] = {"shards": node_shards, "bytes": node_bytes, "samples": node_samples}
        print(json.dumps(report))
        return 0
    b, s = report["bytes_per_node"], report["shards_per_node"]
    print(f"dataset       {source}: {report['samples']:,} samples in {report['shards']:,} shards")
    print(f"layout        {nodes} nodes x {layout.ranks_per_node} ranks = {layout.world_size} ranks")
    print(f"batches/rank  {plan.batches_per_rank:,} (equal on every rank; samples/rank "
          f"{report['samples_per_rank']['min']:,.0f}..{report['samples_per_rank']['max']:,.0f})")
    print(f"padding eff.  {plan.padding_efficiency:.4f}")
    print(f"remainder     {report['remainder']:,} samples not served this epoch (rotate across epochs)")
    print(f"shards/node   min {s['min']:.0f}  mean {s['mean']:.1f}  max {s['max']:.0f}  "
          f"({shared} pieces of shards split between nodes)")
    print(f"bytes/node    min {format_size(b['min'])}  mean {format_size(b['mean'])}  max {format_size(b['max'])} "
          "(whole shards to cache)")
    print(f"planning      {plan_s:.3f} s (epoch plan), {nodes_s:.3f} s (node shards)")
    return 0
