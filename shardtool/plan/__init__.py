"""The plan: which shards each node reads and which batches each rank serves.

Pure numpy functions of the dataset metadata (per-shard summaries, and the lengths of the one
range a rank plans), the layout and the batching config; no torch. The loader, the cache warmer
and `shardtool plan` all call these same functions, so the three agree by construction. Every
decision lives here:

- `layout`    — the job's nodes × ranks (`Layout`), where one process sits (`Placement`), and who
                reads what (`DataLayout`: DP size, data groups, their nodes)
- `env`       — the one reader of torchrun / SLURM variables and explicit overrides
- `mesh`      — data layouts from a device mesh (TP/PP/CP replicas of a DP rank)
- `source`    — what the planner reads (`PlanSource`: summaries + one range's lengths)
- `ranges`    — node-sticky, token-balanced group ranges from the summaries; a node's shards
- `batching`  — the batching config, seeds, length bucketing within shuffle windows
- `shape`     — what every rank computes alike: ranges, window, batches per DP rank
- `balance`   — equal batch counts: the count, surplus dropped (rotating), deficits split
- `group`     — one data group's epoch plan
- `rank`      — one DP rank's batches, over resume segments (`Planner`)
- `state`     — the resumable position
- `packing/`  — sequence packing: `Packing`, `Rows`, best-fit, `pack_rows` (see its ``__init__``)
- `mixture/`  — the mixture: sources, token weights and schedule (`Mixture`), the composition,
                its state, `MixturePlanner`, spans and max_repeat (see its ``__init__``)
- `simulate`  — every group at once, for `shardtool plan`
- `synthetic` — the one lengths generator; a lazy synthetic plan source
"""

from __future__ import annotations

from .batching import PLAN_VERSION, Batching
from .env import LayoutError, array_ids, array_task, node_placement, rank_placement
from .group import GroupPlan, plan_group
from .layout import DataLayout, Layout, Placement
from .mesh import Mesh, data_layout, data_parallel, parse_mesh
from .mixture import Mixture, MixtureError, MixtureSource
from .ranges import group_cuts, group_shard_pieces, sample_locations, shards_of_groups
from .rank import Planner, RankPlan
from .shape import PlanShape, plan_shape
from .source import ArraySource, PlanSource
from .state import LoaderState, Segment, StateError

__all__ = [
    "PLAN_VERSION",
    "ArraySource",
    "Batching",
    "DataLayout",
    "GroupPlan",
    "Layout",
    "LayoutError",
    "LoaderState",
    "Mesh",
    "Mixture",
    "MixtureError",
    "MixtureSource",
    "PlanShape",
    "PlanSource",
    "Placement",
    "Planner",
    "RankPlan",
    "Segment",
    "StateError",
    "array_ids",
    "array_task",
    "data_layout",
    "data_parallel",
    "group_cuts",
    "group_shard_pieces",
    "node_placement",
    "parse_mesh",
    "plan_group",
    "plan_shape",
    "rank_placement",
    "sample_locations",
    "shards_for_node",
    "shards_of_groups",
]


def shards_for_node(summaries, layout: DataLayout, node: int) -> list[int]:
    """Sorted shard indices node ``node`` reads under ``layout``: what its cache must hold."""
    return shards_of_groups(summaries, group_cuts(summaries, layout.group_sizes), layout.groups_on_node(node))
