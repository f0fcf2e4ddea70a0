"""What ``shardtool plan`` and its mixture report (cli/_mixture.py) share: the layout and batching
from the arguments, the shards each node caches, and the peak memory of the planning process."""

from __future__ import annotations

import resource


def peak_rss_mb() -> float:
    """This process's peak resident memory. VmHWM, not rusage: Linux carries ru_maxrss across
    exec, so a freshly spawned child would report its parent's peak."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def layout_of(args):
    from ..plan import Layout

    return Layout(args.simulate_nodes or args.nodes or 1, args.ranks_per_node)


def batching_of(args, source=None):
    from ..plan import Batching
    from ..plan.packing import Packing, with_packed_eos

    packing = Packing(args.seq_len, args.packing, eos_id=args.eos_id) if args.seq_len is not None else None
    manifest = getattr(source, "manifest", None)
    if manifest is not None:  # documents packed with --eos-id end with it already: as the loader plans them
        packing = with_packed_eos(packing, {args.url: manifest.length.get("eos_id")})
    from ..plan.cost import CostModel

    spec = getattr(args, "cost_model", None)
    return Batching(
        batch_size=args.batch_size,
        max_tokens=args.max_tokens,
        shuffle=not args.no_shuffle,
        seed=args.seed,
        packing=packing,
        drop_last={"auto": None, "yes": True, "no": False}[args.drop_last],
        balance=CostModel.parse(spec) if spec else None,
        balance_window=getattr(args, "balance_window", None) if spec else None,
        micro_batches=getattr(args, "micro_batches", None) if spec else None,
        shuffle_block=getattr(args, "shuffle_block", None),
    )


def node_shards(summaries, data, layout, shard_bytes):
    """(per node: the sorted shards it caches, bytes per node) of one dataset under ``data``."""
    import numpy as np

    from ..plan import group_cuts, group_shard_pieces

    pieces = group_shard_pieces(summaries, group_cuts(summaries, data.group_sizes))
    per_node = [sorted({s for g in data.groups_on_node(k) for s, _, _ in pieces[g]}) for k in range(layout.num_nodes)]
    return per_node, np.array([int(shard_bytes[s].sum()) if s else 0 for s in per_node], dtype=np.int64)
