"""Batch-size and sequence-length schedules by training step: which planned batches each step takes.

A run that ramps its batch size (``batch_size={0: 4, 2000: 8, 10000: 16}``) is planned at the
*base* size, the greatest common divisor of the schedule's sizes, and step ``t`` takes the next
``size(t) / base`` of the rank's planned batches as one. The plan, the state's positions, the
elastic re-deal and the equal batch counts are those of the base size, unchanged; the schedule
only says where a step's batches begin and end, from the step's number alone. So every rank
changes at the same step, nothing is repeated or lost across a change (the steps after it take
the batches the steps before it did not), and a state saved before a change resumes across it.

A sequence-length warmup (``seq_len={0: 2048, 50000: 8192}``, packed rows) is planned at the
longest length: a step of shorter rows takes whole planned rows and cuts each into rows of its
length, at token positions (a document crossing a cut goes on in the next row, as a document
longer than a row does). So the tokens, in order, are those of the run at the longest length:
nothing repeated or lost at a change, and the steps after it serve what the steps before it did
not, from the step's number alone as for a batch-size ramp.

A token-budget ramp (``max_tokens={0: 16384, 2000: 65536}``, bucketed batches) is planned at the
smallest budget, and step ``t`` takes the next ``max_tokens(t) / smallest`` planned batches as
a *list* of micro-batches, each padded on its own: joined into one tensor, batches of other
lengths would pad to the longest and overrun the budget. So a step holds at most its budget of
padded tokens, every micro-batch at most the smallest (as a plan at that budget), and a
larger budget is more accumulated micro-batches a step, as Megatron's batch-size ramp is.

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

__all__ = [
    "RUN_STEPS",
    "Schedule",
    "StepClock",
    "budget_schedule",
    "parse_schedule",
    "parse_schedule_text",
    "value_at",
    "with_runs",
    "with_seq_lens",
]

# Bucketed batches of a schedule are dealt in runs of RUN_STEPS steps of its largest size (see
# `Batching.run_batches`): a step that begins inside a run takes batches of like lengths, and one
# in RUN_STEPS of the largest steps at most straddles two runs where a change left the steps out
# of step with the runs. Longer runs pad less and let lengths trend over more steps.
RUN_STEPS = 4


@dataclass(frozen=True)
class Schedule:
    """``changes``: (first step, size) pairs, sorted, the first at step 0. ``seq_lens``: the same
    for the length of packed rows (empty: one length). The plan's rows are of the longest length
    (`row_len`) and its batches of `base` of them; a step of rows shorter than that takes whole
    planned rows and cuts each into ``row_len / seq_len`` rows (`shardtool.plan.rowsplit.cut_rows`)."""

    changes: tuple[tuple[int, int], ...]
    seq_lens: tuple[tuple[int, int], ...] = ()
    unit: str = "batch_size"  # what ``changes`` schedule: "batch_size", or "max_tokens" (budgets)

    @property
    def micro(self) -> bool:
        """A token-budget ramp: a step's planned batches are served as a list, one micro-batch
        each, not joined (`budget_schedule`)."""
        return self.unit == "max_tokens"

    @property
    def row_len(self) -> int | None:
        """The planned rows' length: the longest of ``seq_lens``; None without them."""
        return max(n for _, n in self.seq_lens) if self.seq_lens else None

    @property
    def base(self) -> int:
        """The plan's batch size: the greatest common divisor of the steps' `units_at`."""
        return math.gcd(*(self.units_at(first) for first in self.firsts))

    @property
    def largest(self) -> int:
        return max(size for _, size in self.changes)

    @property
    def firsts(self) -> list[int]:
        """Every step where the size or the row length changes, from 0."""
        return sorted({first for first, _ in self.changes} | {first for first, _ in self.seq_lens})

    @property
    def run_batches(self) -> int:
        """Planned batches per run of like lengths (`Batching.run_batches`) for bucketed batches."""
        return RUN_STEPS * self.largest // self.base

    def size_at(self, step: int) -> int:
        """The batch size (samples, or rows of packed batches) of the run's step ``step``."""
        return value_at(self.changes, step)

    def seq_len_at(self, step: int) -> int | None:
        """The length of step ``step``'s packed rows; None without a ``seq_lens`` schedule."""
        return value_at(self.seq_lens, step) if self.seq_lens else None

    def units_at(self, step: int) -> int:
        """The planned rows (or samples) step ``step`` takes: its size, or with ``seq_lens`` its
        rows' tokens in rows of `row_len` (`with_seq_lens` checks that they are whole)."""
        size, row_len = self.size_at(step), self.row_len
        if row_len is None:
            return size
        return size * value_at(self.seq_lens, step) // row_len

    def cut(self, first_step: int, count: int) -> np.ndarray:
        """The steps that take ``count`` planned batches from the run's step ``first_step`` on:
        positions ``[0, p1, ..., count]``, step ``first_step + j`` taking ``p_j .. p_{j+1} - 1``."""
        if count <= 0:
            return np.zeros(1, np.int64)
        parts = [np.zeros(1, np.int64)]
        at, step = 0, first_step
        firsts = self.firsts
        for i, first in enumerate(firsts):
            end = firsts[i + 1] if i + 1 < len(firsts) else None
            if end is not None and end <= step:
                continue
            k = self.units_at(first) // self.base
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
        rank, by size: ``{"from_step", "to_step" (inclusive), "size", "steps", "batches"}``, and
        ``"seq_len"`` where the row length is scheduled too."""
        cut = self.cut(first_step, batches)
        out: list[dict[str, int]] = []
        for j, (a, b) in enumerate(zip(cut[:-1].tolist(), cut[1:].tolist())):
            step = first_step + j
            shape = {"size": self.size_at(step)}
            if self.seq_lens:
                shape["seq_len"] = value_at(self.seq_lens, step)
            if out and all(out[-1][k] == v for k, v in shape.items()):
                out[-1].update(to_step=step, steps=out[-1]["steps"] + 1, batches=out[-1]["batches"] + b - a)
            else:
                out.append({"from_step": step, "to_step": step, **shape, "steps": 1, "batches": b - a})
        return out

    def describe(self) -> str:
        sizes = ", ".join(f"step {first}: {size}" for first, size in self.changes)
        if self.micro:
            return f"max_tokens {sizes}"
        if not self.seq_lens:
            return sizes
        return f"{sizes}; seq_len " + ", ".join(f"step {first}: {n}" for first, n in self.seq_lens)


def value_at(changes: tuple[tuple[int, int], ...], step: int) -> int:
    """The value of ``changes`` ((first step, value), ..., sorted, the first at step 0) at ``step``."""
    value = changes[0][1]
    for first, v in changes:
        if first > step:
            break
        value = v
    return value


def budget_schedule(value: Any) -> Schedule:
    """``max_tokens={first step: budget}`` checked: the plan's batches are of the smallest budget
    and a step takes ``budget / smallest`` of them, so every budget must be a multiple of the
    smallest (ValueError naming the one that is not)."""
    schedule = replace(parse_schedule("max_tokens", value), unit="max_tokens")
    smallest = min(size for _, size in schedule.changes)
    for first, size in schedule.changes:
        if size % smallest:
            raise ValueError(
                f"max_tokens schedule: {size} (from step {first}) is not a multiple of the smallest budget "
                f"{smallest}; batches are planned at {smallest} tokens and a step takes a whole number of them"
            )
    return schedule


def with_seq_lens(batch_size: int | Schedule, seq_lens: Schedule) -> Schedule:
    """A schedule of ``batch_size`` rows (one size, or by step) whose rows' length changes by
    step as ``seq_lens`` says (its sizes are lengths). Rows are planned at the longest length; a
    step takes its rows' tokens in whole planned rows, so every length must divide the longest
    and every step's rows must fill whole planned rows: ValueError naming the step otherwise."""
    sizes = batch_size.changes if isinstance(batch_size, Schedule) else ((0, int(batch_size)),)
    out = Schedule(sizes, seq_lens.changes)
    longest = out.row_len or 0
    for first, n in seq_lens.changes:
        if longest % n:
            raise ValueError(
                f"seq_len schedule: {n} (from step {first}) does not divide the longest seq_len {longest}; rows "
                f"are planned {longest} tokens long and cut into shorter ones, so each length must divide it"
            )
    for first in out.firsts:
        rows, n = out.size_at(first), value_at(seq_lens.changes, first)
        if rows * n % longest:
            raise ValueError(
                f"from step {first}, {rows} rows of {n} tokens do not make whole rows of {longest} (the longest "
                f"seq_len, which the plan packs): give a batch_size there that is a multiple of {longest // n}"
            )
    return out


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
    if schedule is None or schedule.micro or batching.packing is not None:
        return batching  # a budget ramp's micro-batches are padded one by one: no join to keep short
    if not (batching.bucketing and batching.shuffle):
        return batching
    # Windows sized for the largest batches (as a loader of that size sorts them), not the base's.
    window = batching.window if batching.window is not None else WINDOW_BATCHES * schedule.largest
    return replace(batching, run_batches=schedule.run_batches, window=window)


def parse_schedule_text(text: str, name: str = "batch_size") -> int | Schedule:
    """``"8"`` or ``"0:4,2000:8"`` (first step:size, ...), as the command line gives a batch size
    (or, ``name``, a row length)."""
    if ":" not in text:
        return int(text)
    pairs = {}
    for part in text.split(","):
        step, _, size = part.partition(":")
        pairs[int(step)] = int(size)
    return parse_schedule(name, pairs)


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
