"""What `ShardedLoader` reads from: one dataset by epochs, or a mixture by steps, chosen once.

The loader is one class; which batches it serves, and how its position is counted and saved, is
a `BatchSource` picked when it is built (loader/sharded.py's ``open_source``): `DatasetEpochs`
(loader/epochs.py) for a URL, `MixtureSteps` (loader/mixed.py) for a `Mixture`. The loader keeps
what every source shares: the options, this rank's place, the worker pool, the metrics and the
staging. A source keeps its readers, its plan and its position, and builds each pass's batches.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Protocol

from ..plan import Batching
from ..plan.layout import DataLayout, Placement
from ..plan.packing import with_packed_eos
from ..plan.schedule import Schedule
from .options import BatchOptions
from .reader import BatchReader

log = logging.getLogger(__name__)

__all__ = ["BatchSource", "PassBatches", "Reading", "without_double_eos"]


@dataclass(frozen=True)
class Reading:
    """What every source is built with: the checked keywords and where this rank reads."""

    opts: BatchOptions
    bucketing: bool | None  # as given: None lets the dataset decide (`default_bucketing`)
    image_transform: Any
    placement: Placement
    data_layout: DataLayout
    dp_rank: int
    cache_dir: str | None
    storage_options: dict | None


@dataclass(frozen=True)
class PassBatches:
    """A pass from the source's position: the workers' batches, the pass's first and last
    batch, the words that name it in errors, and for staging the plan it reads (one dataset)."""

    batches: Any  # `PlanBatches` or `MixtureBatches`: what the worker pool maps over
    start: int
    stop: int
    where: str
    plan: Any = None  # the `RankPlan` a one-dataset pass reads, which staging follows


class BatchSource(Protocol):
    """The part of a loader that differs between one dataset and a mixture."""

    readers: dict[str, BatchReader]  # by source name: what the metrics count and close() closes
    token_fields: tuple[str, ...]
    schedule: Schedule | None  # batch size and row length by step, as given (None: one of each)

    @property
    def staged(self) -> Any:
        """The `shardtool.loader.source.Source` in-job staging fills, or None (not staged)."""

    @property
    def planner(self) -> Any: ...

    @property
    def batching(self) -> Any: ...

    @property
    def metric_epoch(self) -> int:
        """The epoch the metric lines and staging count (a mixture: 0, its run is one pass)."""

    @property
    def served(self) -> int:
        """Batches of the current pass's numbering handed over (where ``next()`` continues)."""

    @property
    def resuming(self) -> bool: ...

    @property
    def length_field(self) -> str | None: ...

    def length(self) -> int:
        """``len(loader)``."""

    def left(self) -> int:
        """``batches_left``."""

    def at_end(self) -> bool:
        """Every batch of the current epoch was handed over (the next one has not begun)."""

    def next_pass(self) -> None:
        """After `at_end`, or at a pass's end: move on to what the next pass serves."""

    def begin_pass(self) -> PassBatches: ...

    def handed_over(self, b: int) -> int:
        """The position once the pass's batch ``b`` was handed over (it becomes `served`)."""

    def check_ranks_agree(self, agree: Any) -> None:
        """Once per position: ``agree(numbers, ident, what, fix)`` that every rank reads alike."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def skip_steps(self, first: int, stop: int) -> None: ...


def without_double_eos(batching: Batching, packed_eos: dict[str, int | None]) -> Batching:
    """Documents packed with --eos-id already end with it: the loader appends no other."""
    packing = with_packed_eos(batching.packing, packed_eos)
    if packing is batching.packing:
        return batching
    eos = batching.packing.eos_id if batching.packing is not None else None
    log.info("documents already end with EOS id %d (packed with --eos-id): the loader appends none", eos)
    return replace(batching, packing=packing)
