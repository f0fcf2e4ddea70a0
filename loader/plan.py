"""The plan: which shards each node reads and which batches each rank serves.

Pure numpy functions of the dataset metadata (sample lengths and shard counts),
the node layout and the batching config; no I/O, no torch. The loader, the
cache warmer and `shardtool plan` all call these same functions, so the three
agree by construction. The implementation lives in `loader.planning`.
"""

from __future__ import annotations

from .planning.batching import PLAN_VERSION, Batching, resolve_window
from .planning.epoch import EpochPlan, plan_epoch
from .planning.nodes import node_ranges, node_shard_ranges, sample_locations, shards_for_node

__all__ = [
    "PLAN_VERSION",
    "Batching",
    "EpochPlan",
    "node_ranges",
    "node_shard_ranges",
    "plan_epoch",
    "resolve_window",
    "sample_locations",
    "shards_for_node",
]


def _bench() -> None:
    """Print planning times on synthetic lognormal lengths (median ~350 tokens)."""
    import time

    import numpy as np

    from .world import Layout

    rng = np.random.default_rng(0)
    cases = [
        (200_000, Layout(1, 1), Batching(max_tokens=65536)),
        (200_000, Layout(1, 1), Batching(batch_size=32)),
        (1_000_000, Layout(64, 8), Batching(max_tokens=65536)),
        (1_000_000, Layout(64, 8), Batching(batch_size=32)),
    ]
    for num_samples, layout, batching in cases:
        lengths = np.clip(rng.lognormal(np.log(350), 1.0, num_samples), 0, 8192).astype(np.int64)
        counts = np.full(num_samples // 1000, 1000)
        plan_epoch(lengths, counts, layout, batching, 0)  # warm caches and imports
        began = time.perf_counter()
        plan = plan_epoch(lengths, counts, layout, batching, 1)
        took = time.perf_counter() - began
        print(
            f"{num_samples:>9,} samples  {layout.num_nodes:>3} nodes x {layout.ranks_per_node} ranks  "
            f"{batching.batch_size and f'batch_size={batching.batch_size}' or f'max_tokens={batching.max_tokens}':<18} "
            f"{took:6.3f} s  {plan.batches_per_rank} batches/rank  "
            f"remainder {plan.remainder.size}  padding efficiency {plan.padding_efficiency:.3f}"
        )


if __name__ == "__main__":
    _bench()
