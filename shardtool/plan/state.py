"""Resumable loader state: a position in a deterministic plan, not a history.

The state names the epoch and, per *segment* of that epoch, the layout it ran
on and how many batches every rank served. Segment 0 is the epoch's plan; each
resume onto a different layout closes the last segment and plans what is left
of the epoch on the new layout as a new segment. Replaying the chain of plans
(pure functions) recovers exactly which samples were served, so the state stays
a few numbers, identical on every rank, whatever the dataset size.

Remainder rule: a sample is "remaining" until it has been served. Samples left
in a segment's remainder are therefore eligible again in the next segment; a
sample is never served twice in an epoch, and at the end of the epoch the
unserved samples are exactly the last segment's remainder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from .batching import Batching
from .epoch import EpochPlan, plan_subset
from .layout import Layout

__all__ = [
    "STATE_VERSION",
    "LoaderState",
    "check_compatible",
    "plan_for_state",
    "remaining_subset",
]

STATE_VERSION = 1


def _segment(world_size: Any, ranks_per_node: Any, served: Any) -> dict[str, int]:
    for name, value, low in (("world_size", world_size, 1), ("ranks_per_node", ranks_per_node, 1), ("served", served, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"segment {name} must be an int >= {low}, found {value!r}")
    if world_size % ranks_per_node:
        raise ValueError(
            f"segment world_size must be a multiple of ranks_per_node: found {world_size}, {ranks_per_node}"
        )
    return {"world_size": world_size, "ranks_per_node": ranks_per_node, "served": served}


def _layout_of(segment: Mapping[str, int]) -> Layout:
    return Layout(segment["world_size"] // segment["ranks_per_node"], segment["ranks_per_node"])


@dataclass
class LoaderState:
    """Where the loader is: epoch, and batches served per rank in each layout segment."""

    epoch: int
    dataset_fingerprint: str
    batching_fingerprint: str
    segments: list[dict[str, int]] = field(default_factory=list)
    version: int = STATE_VERSION

    @classmethod
    def start(cls, epoch: int, dataset_fingerprint: str, batching: Batching, layout: Layout) -> "LoaderState":
        """The state before the first batch of `epoch` on `layout`."""
        return cls(epoch, dataset_fingerprint, batching.fingerprint(), [_segment(layout.world_size, layout.ranks_per_node, 0)])

    def resumed_on(self, layout: Layout) -> "LoaderState":
        """This state continued on `layout`: a new segment if the layout changed (pair with `plan_for_state`)."""
        if self.segments and _layout_of(self.segments[-1]) == layout:
            return self.copy()
        new = self.copy()
        new.segments.append(_segment(layout.world_size, layout.ranks_per_node, 0))
        return new

    def with_served(self, served: int) -> "LoaderState":
        """This state after every rank has served `served` batches of the current segment."""
        if not self.segments:
            raise ValueError("state has no segment to advance; create it with LoaderState.start")
        new = self.copy()
        last = new.segments[-1]
        new.segments[-1] = _segment(last["world_size"], last["ranks_per_node"], served)
        return new

    def copy(self) -> "LoaderState":
        return LoaderState(
            self.epoch, self.dataset_fingerprint, self.batching_fingerprint,
            [dict(s) for s in self.segments], self.version,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "epoch": self.epoch,
            "dataset_fingerprint": self.dataset_fingerprint,
            "batching_fingerprint": self.batching_fingerprint,
            "segments": [dict(s) for s in self.segments],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "LoaderState":
        if not isinstance(data, Mapping):
            raise ValueError(f"loader state must be a mapping, found {type(data).__name__}")
        expected = {"version", "epoch", "dataset_fingerprint", "batching_fingerprint", "segments"}
        if set(data) != expected:
            raise ValueError(f"loader state keys: found {sorted(data)}, expected {sorted(expected)}")
        if data["version"] != STATE_VERSION:
            raise ValueError(f"unsupported loader state version: found {data['version']!r}, expected {STATE_VERSION}")
        epoch = data["epoch"]
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"loader state epoch must be an int >= 0, found {epoch!r}")
        for key in ("dataset_fingerprint", "batching_fingerprint"):
            if not isinstance(data[key], str):
                raise ValueError(f"loader state {key} must be a string, found {data[key]!r}")
        segments = data["segments"]
        if not isinstance(segments, Sequence) or isinstance(segments, str) or not segments:
            raise ValueError(f"loader state segments must be a non-empty list, found {segments!r}")
        parsed = []
        for seg in segments:
            if not isinstance(seg, Mapping) or set(seg) != {"world_size", "ranks_per_node", "served"}:
                raise ValueError(
                    f"loader state segment: found {seg!r}, expected keys world_size, ranks_per_node, served"
                )
            parsed.append(_segment(seg["world_size"], seg["ranks_per_node"], seg["served"]))
        return cls(epoch, data["dataset_fingerprint"], data["batching_fingerprint"], parsed, STATE_VERSION)


def check_compatible(state: LoaderState, dataset_fingerprint: str, batching: Batching) -> None:
    """Refuse a state saved for another dataset, batching config or state version."""
    if state.version != STATE_VERSION:
        raise ValueError(f"unsupported loader state version: found {state.version!r}, expected {STATE_VERSION}")
    if state.dataset_fingerprint != dataset_fingerprint:
        raise ValueError(
            "loader state was saved for another dataset: found dataset fingerprint "
            f"{state.dataset_fingerprint!r}, expected {dataset_fingerprint!r}"
        )
    _check_batching(state, batching)


def _check_batching(state: LoaderState, batching: Batching) -> None:
    if state.batching_fingerprint != batching.fingerprint():
        raise ValueError(
            "loader state was saved with another batching config: found fingerprint "
            f"{state.batching_fingerprint!r}, expected {batching.fingerprint()!r} for {batching}"
        )


def _replay(lengths, shard_counts, batching: Batching, epoch: int, segments) -> tuple[np.ndarray, EpochPlan | None]:
    """(mask of samples not served after all segments, plan of the last segment)."""
    remaining = np.ones(np.asarray(lengths).shape[0], dtype=bool)
    plan = None
    for i, raw in enumerate(segments):
        seg = _segment(raw["world_size"], raw["ranks_per_node"], raw["served"])
        plan = plan_subset(
            lengths, shard_counts, _layout_of(seg), batching, epoch,
            subset=None if i == 0 else remaining, allow_empty=i > 0,
        )
        if seg["served"] > plan.batches_per_rank:
            raise ValueError(
                f"segment {i} of the loader state says {seg['served']} batches served per rank, "
                f"but its plan has only {plan.batches_per_rank}: found a state from another dataset or config"
            )
        remaining[plan.served_ids(seg["served"])] = False
    return remaining, plan


def remaining_subset(lengths, shard_counts, batching: Batching, epoch: int, segments_so_far) -> np.ndarray:
    """Boolean mask of this epoch's samples not yet served after the given segments.

    Segment 0 is the full plan of the epoch; segment i+1 plans, on its own
    layout, the samples segment i left unserved (its remainder included).
    """
    return _replay(lengths, shard_counts, batching, epoch, segments_so_far)[0]


def plan_for_state(lengths, shard_counts, layout: Layout, batching: Batching, state: LoaderState) -> tuple[EpochPlan, int]:
    """The plan to continue `state` on `layout`, and the batch index every rank starts at.

    Same layout as the last segment: that segment's plan, from `served` on, so
    the rest is exactly what an uninterrupted run would have yielded. Another
    layout: the samples not yet served, planned on `layout`, from batch 0
    (record it with `state.resumed_on(layout)`). If too few samples remain to
    give every rank a batch, the plan has zero batches and they all form its remainder.
    """
    _check_batching(state, batching)
    if not state.segments:
        raise ValueError("loader state has no segments; create it with LoaderState.start")
    same_layout = _layout_of(state.segments[-1]) == layout  # first: a bad last segment fails here, as before
    remaining, plan = _replay(lengths, shard_counts, batching, state.epoch, state.segments)
    if same_layout:
        return plan, state.segments[-1]["served"]
    plan = plan_subset(lengths, shard_counts, layout, batching, state.epoch, subset=remaining, allow_empty=True)
    return plan, 0
