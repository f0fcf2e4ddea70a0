"""The plan: which shards each node reads and which batches each rank serves.

Pure numpy functions of the dataset metadata (sample lengths and shard counts), the layout and the
batching config; no I/O, no torch. The loader, the cache warmer and `shardtool plan` all call these
same functions, so the three agree by construction. Every decision lives here:

- `layout`    — the job's nodes × ranks (`Layout`) and where one process sits in it (`Placement`)
- `env`       — the one reader of torchrun / SLURM variables and explicit overrides
- `ranges`    — node-sticky, token-balanced sample ranges; the shards a node must hold
- `batching`  — the batching config, seeds, length bucketing within shuffle windows
- `balance`   — equal batch counts on every rank: surplus dropped (rotating), deficits split
- `epoch`     — one epoch's exact ordered batches of every rank
- `state`     — the resumable position (segments for elastic resume)
- `synthetic` — the one lengths generator for synthetic corpora (tests, benchmarks, `--synthetic`)
"""

from __future__ import annotations

from .batching import PLAN_VERSION, Batching, resolve_window
from .env import LayoutError, array_task, node_placement, rank_placement
from .epoch import EpochPlan, plan_epoch
from .layout import Layout, Placement
from .ranges import node_ranges, node_shard_ranges, sample_locations, shards_for_node
from .state import LoaderState

__all__ = [
    "PLAN_VERSION",
    "Batching",
    "EpochPlan",
    "Layout",
    "LayoutError",
    "LoaderState",
    "Placement",
    "array_task",
    "node_placement",
    "node_ranges",
    "node_shard_ranges",
    "plan_epoch",
    "rank_placement",
    "resolve_window",
    "sample_locations",
    "shards_for_node",
]
