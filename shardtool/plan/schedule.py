"""A batch-size schedule by training step: which of the plan's batches each step takes.

A run that ramps its batch size (``batch_size={0: 4, 2000: 8, 10000: 16}``) is planned at the
*base* size, the greatest common divisor of the schedule's sizes, and step ``t`` takes the next
``size(t) / base`` of the rank's planned batches as one. The plan, the state's positions, the
elastic re-deal and the equal batch counts are those of the base size, unchanged; the schedule
only says where a step's batches begin and end, from the step's number alone. So every rank
changes at the same step, nothing is repeated or lost across a change (the steps after it take
the batches the steps before it did not), and a state saved before a change resumes across it.

The steps are the run's, counted across epochs: an epoch that begins at step ``s`` with ``n``
batches a rank has the steps `cut` gives, its last one short when ``n`` does not divide.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .batching import WINDOW_BATCHES, Batching
from .state import LoaderState, StateError

__all__ = ["RUN_STEPS", "Schedule", "StepClock", "parse_schedule", "parse_schedule_text", "with_runs"]

# Bucketed batches of a schedule are dealt in runs of RUN_STEPS steps of its largest size (see
# `Batching.run_batches`): a step that begins inside a run takes batches of like lengths, and one
# in RUN_STEPS of the largest steps at most straddles two runs where a change left the steps out
# of step with the runs. Longer runs pad less and let lengths trend over more steps.
RUN_STEPS = 4


@dataclass(frozen=True)
class Schedule:
    """``changes``: (first step, size) pairs, sorted, the first at step 0; ``base``: their gcd."""

    changes: tuple[tuple[int, int], ...]

    @property
    def base(self) -> int:
        return math.gcd(*(size for _, size in self.changes))

    @property
    def largest(self) -> int:
        return max(size for _, size in self.changes)

    @property
    def run_batches(self) -> int:
        """Planned batches per run of like lengths (`Batching.run_batches`) for bucketed batches."""
        return RUN_STEPS * self.largest // self.base

    def size_at(self, step: int) -> int:
        """The batch size (samples, or rows of packed batches) of the run's step ``step``."""
        size = self.changes[0][1]
        for first, value in self.changes:
            if first > step:
                break
            size = value
        return size

    def cut(self, first_step: int, count: int) -> np.ndarray:
        """The steps that take ``count`` planned batches from the run's step ``first_step`` on:
        positions ``[0, p1, ..., count]``, step ``first_step + j`` taking ``p_j .. p_{j+1} - 1``."""
        if count <= 0:
            return np.zeros(1, np.int64)
        parts = [np.zeros(1, np.int64)]
        at, step = 0, first_step
        for i, (first, size) in enumerate(self.changes):
            end = self.changes[i + 1][0] if i + 1 < len(self.changes) else None
            if end is not None and end <= step:
                continue
            k = size // self.base
            steps = (count - at + k - 1) // k if end is None else min(end - step, (count - at + k - 1) // k)
            cuts = at + k * np.arange(1, steps + 1, dtype=np.int64)
            parts.append(np.minimum(cuts, count))
            at, step = int(min(at + k * steps, count)), step + steps
            if at >= count:
                break
        return np.concatenate(parts)

    def steps(self, first_step: int, count: int) -> int:
        """How many steps take ``count`` planned batches from the run's step ``first_step`` on."""
        return int(self.cut(first_step, count).size - 1)

    def epoch_first_step(self, epoch: int, batches: int) -> int:
        """The run's step at ``epoch``'s first batch, every epoch before it run whole with
        ``batches`` planned batches a rank (a plan's count is the same every epoch)."""
        step = 0
        for _ in range(epoch):
            step += self.steps(step, batches)
        return step

    def phases(self, first_step: int, batches: int) -> list[dict[str, int]]:
        """The steps of an epoch that begins at ``first_step`` with ``batches`` planned batches a
        rank, by size: ``{"from_step", "to_step" (inclusive), "size", "steps", "batches"}``."""
        cut = self.cut(first_step, batches)
        out: list[dict[str, int]] = []
        for j, (a, b) in enumerate(zip(cut[:-1].tolist(), cut[1:].tolist())):
            step, size = first_step + j, self.size_at(first_step + j)
            if out and out[-1]["size"] == size:
                out[-1].update(to_step=step, steps=out[-1]["steps"] + 1, batches=out[-1]["batches"] + b - a)
            else:
                out.append({"from_step": step, "to_step": step, "size": size, "steps": 1, "batches": b - a})
        return out

    def describe(self) -> str:
        return ", ".join(f"step {first}: {size}" for first, size in self.changes)


@dataclass(frozen=True)
class StepClock:
    """A schedule's steps over one epoch's state: the epoch begins at the run's step
    ``first_step``; its segments (one per layout it ran on) take their delivered batches in steps
    from where the segment before left the count (skipped batches are no steps)."""

    schedule: Schedule
    first_step: int

    def segment_step(self, state: LoaderState) -> int:
        """The run's step at the first batch of ``state``'s current (last) segment."""
        step = self.first_step
        for seg in state.segments[:-1]:
            step += self.schedule.steps(step, seg.delivered)
        return step

    def steps(self, state: LoaderState) -> tuple[int, int]:
        """(steps handed over, steps) of the epoch, counted from its first step."""
        step = self.segment_step(state)
        done = step + self.schedule.steps(step, state.last.delivered)
        total = step + self.schedule.steps(step, state.last.steps)
        return done - self.first_step, total - self.first_step

    def segment_cut(self, state: LoaderState) -> tuple[int, np.ndarray]:
        """(steps of the epoch before the current segment, `Schedule.cut` of its batches): step
        ``before + j`` takes the segment's delivered batches ``cut[j] .. cut[j + 1] - 1``."""
        step = self.segment_step(state)
        return step - self.first_step, self.schedule.cut(step, state.last.steps)

    def batches(self, state: LoaderState, first: int, stop: int) -> tuple[int, int]:
        """The epoch's delivered batches of steps ``first .. stop - 1`` (as `LoaderState.skipping`
        takes them): only steps of the current segment not yet served; StateError otherwise."""
        done, total = self.steps(state)
        if not (isinstance(first, int) and isinstance(stop, int)) or not done <= first < stop <= total:
            raise StateError(
                f"steps to skip must be first:stop with {done} <= first < stop <= {total} (the epoch's steps "
                f"not yet served), found {first!r}:{stop!r}"
            )
        earlier = state.served - state.last.delivered  # batches delivered on earlier layouts
        before, cut = self.segment_cut(state)
        return earlier + int(cut[first - before]), earlier + int(cut[stop - before])


def with_runs(batching: Batching, schedule: Schedule | None) -> Batching:
    """``batching`` (its ``batch_size`` the schedule's base, its bucketing resolved) as a schedule
    plans it: bucketed batches, sorted by length and shuffled, are dealt in runs of like lengths
    (`Batching.run_batches`), so that a step joining consecutive batches pads little. Packed rows
    and batches not sorted by length are planned as they are."""
    if schedule is None or batching.packing is not None or not (batching.bucketing and batching.shuffle):
        return batching
    # Windows sized for the largest batches (as a loader of that size sorts them), not the base's.
    window = batching.window if batching.window is not None else WINDOW_BATCHES * schedule.largest
    return replace(batching, run_batches=schedule.run_batches, window=window)


def parse_schedule_text(text: str) -> int | Schedule:
    """``"8"`` or ``"0:4,2000:8"`` (first step:size, ...), as the command line gives a batch size."""
    if ":" not in text:
        return int(text)
    pairs = {}
    for part in text.split(","):
        step, _, size = part.partition(":")
        pairs[int(step)] = int(size)
    return parse_schedule("batch_size", pairs)


def parse_schedule(name: str, value: Any) -> Schedule:
    """``{first step: size}`` checked: int steps from 0, int sizes >= 1; ValueError naming ``name``."""
    if not isinstance(value, Mapping) or not value:
        raise ValueError(f"{name} schedule must be a non-empty dict {{first step: size}}, found {value!r}")
    changes = []
    for step, size in value.items():
        if isinstance(step, str) and step.strip().isdigit():  # from a JSON or YAML file
            step = int(step)
        ok_step = isinstance(step, int) and not isinstance(step, bool) and step >= 0
        ok_size = isinstance(size, int) and not isinstance(size, bool) and size >= 1
        if not (ok_step and ok_size):
            raise ValueError(
                f"{name} schedule maps first steps (ints >= 0) to sizes (ints >= 1), found {step!r}: {size!r}"
            )
        changes.append((step, size))
    changes.sort()
    if changes[0][0] != 0:
        raise ValueError(f"{name} schedule must say the size from step 0, found first step {changes[0][0]}")
    return Schedule(tuple(changes))
