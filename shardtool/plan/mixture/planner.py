"""One DP rank's units of a mixture: per step, which source-epoch units of which sources.

`MixturePlanner` holds one `Planner` per source (its own node-sticky ranges, seed and epochs)
and the composition (`shardtool.plan.mixture.compose`). Every DP rank takes the same number of units of
each source at every step, so every rank's cursor into a source is the same number: a source's
epochs roll over on every rank at the same step, an elastic resume re-deals each source exactly
as a single dataset (`Planner.continue_on`), and the state stays a few numbers per source
(`shardtool.plan.mixture.state`). A rank plans only its own units: its group's plan of each source's
current epoch (and, after a re-deal, of the groups its units come from).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np

from ..about import NO_DESCRIPTION, batching_mismatch, describe_mixture, ranges_changed
from ..batching import Batching
from ..layout import DataLayout
from ..rank import Planner, RankPlan
from ..schedule import Schedule
from ..shape import PlanShape
from ..source import PlanSource
from ..state import LoaderState, StateError
from .compose import Composition, StepUnits, integer_shares
from .config import Mixture, MixtureError, source_batching
from .state import MixtureState, Phase, SourceRecord, mixture_fingerprint

__all__ = ["MixturePlanner", "Piece", "rows_by_step", "served_tokens"]

Piece = tuple[int, int, int]  # (source-epoch, first unit index in the rank's plan of that epoch, units)


def served_tokens(shape: PlanShape, tokens: int) -> int:
    """Tokens one source-epoch serves on ``shape``'s layout: all but the batches equal counts drop
    (exact in batch_size mode, estimated from the summaries otherwise: the same estimate that chose
    the count). What makes expected tokens per unit, and so token shares, accurate to the part of
    the remainder the estimate misses (about 0.1% on corpora of 10^5 samples and more)."""
    batches = np.asarray(shape.group_batches, dtype=np.float64)
    surplus = np.maximum(batches - shape.group_sizes * shape.batches_per_rank, 0.0)
    per_batch = np.divide(shape.group_tokens, batches, out=np.zeros_like(batches), where=batches > 0)
    return max(int(round(tokens - float((surplus * per_batch).sum()))), 1)


def rows_by_step(schedule: Schedule | None, batching: Batching) -> tuple[Batching, tuple[tuple[int, int], ...] | None]:
    """(the batching a mixture plans with, its rows by step) for ``batch_size={first step: rows}``
    and ``seq_len={first step: length}`` (``schedule``; None: one size). A packed mixture's step
    takes its rows from where the steps before it left off, so rows may change at any step; the
    batching keeps the first size, so that a state of a run of that one size resumes under the
    ramp and the other way round. Under a warmup the rows by step are rows of the longest length,
    which the shorter steps cut. ValueError for what a mixture cannot take by step."""
    if schedule is None:
        return batching, None
    if schedule.micro:
        raise ValueError(
            "max_tokens by step is not supported for a mixture: its bucketed step is one batch of one source; "
            "give one max_tokens (a packed mixture ramps batch_size, rows by step)"
        )
    if batching.packing is None:
        raise ValueError(
            "batch_size by step is for packed mixtures (seq_len=...): a bucketed mixture's step is one "
            "batch of one source; give one batch_size"
        )
    # A sequence-length warmup's rows are planned at the longest length, and a step of shorter
    # rows takes its tokens in whole planned rows (`Schedule.units_at`), cut when it is read.
    units = tuple((first, schedule.units_at(first)) for first in schedule.firsts)
    return replace(batching, batch_size=units[0][1]), units


class MixturePlanner:
    """Plans of one mixture, batching config and data layout; cheap to keep for a loader's life."""

    def __init__(
        self,
        mixture: Mixture,
        sources: Mapping[str, PlanSource],
        versions: Mapping[str, str],
        batching: Batching,
        layout: DataLayout,
        rows: Sequence[tuple[int, int]] | None = None,
    ):
        """``rows``: a packed mixture's rows by step ((first step, rows), ..., the first at step
        0, as a batch-size `Schedule`'s changes); None: ``batching.batch_size`` every step."""
        self.mixture, self.batching, self.layout = mixture, batching, layout
        self.fingerprint = mixture_fingerprint(batching)
        self.about = describe_mixture({src.name: src.url for src in mixture.sources}, batching)
        self.planners = {n: Planner(sources[n], source_batching(batching, n)) for n in mixture.names}
        self.versions = {n: versions[n] for n in mixture.names}
        self.units_per_step = batching.batch_size if batching.packing is not None else 1
        # Recorded in each phase only where the rows ramp: a state of one size keeps its form.
        self.rows: tuple[tuple[int, int], ...] = tuple(rows) if rows is not None and len(rows) > 1 else ()
        if self.rows and batching.packing is None:
            raise MixtureError("rows by step are for packed mixtures: a bucketed mixture's step is one source's batch")
        extra = batching.packing.extra_tokens if batching.packing is not None else 0
        self.tokens = {}
        for n, p in self.planners.items():
            s = p.source.summaries
            self.tokens[n] = int(s.tokens.sum()) + extra * int(s.samples.sum())
            if self.tokens[n] <= 0:
                raise MixtureError(
                    f"source {n!r} ({mixture.sources[mixture.names.index(n)].url}) has no tokens: "
                    "token weights cannot draw from it"
                )
        self._compositions: dict[int, tuple[Phase, Composition]] = {}

    # ------------------------------------------------------------------ phases
    def _record(self, name: str, position: LoaderState) -> SourceRecord:
        shape = self.planners[name].shape(self.layout)
        return SourceRecord(
            name,
            self.versions[name],
            served_tokens(shape, self.tokens[name]),
            self.layout.dp_size * shape.batches_per_rank,
            position,
        )

    def start(self) -> MixtureState:
        """The state before step 0 (ValueError if a source cannot be planned on this layout)."""
        records = [
            self._record(n, self.planners[n].start(0, self.versions[n], self.layout)) for n in self.mixture.names
        ]
        return MixtureState(
            0,
            self.fingerprint,
            Phase(0, self.mixture.schedule_identity(), self.layout, records, rows=self.rows),
            about=self.about,
        )

    def resume(self, state: MixtureState) -> MixtureState:
        """``state`` continued under this mixture and layout: the same phase if nothing changed,
        else a new phase from its step in which every kept source continues from its cursor (its
        current epoch re-dealt if the layout changed), a new source starts at epoch 0 unit 0, and
        a removed one is dropped. Refuses a state of another dataset version or config."""
        if state.fingerprint != self.fingerprint:
            raise StateError(batching_mismatch(state.about, state.fingerprint, self.about, self.fingerprint))
        phase = state.phase
        dp = phase.layout.dp_size
        for rec in phase.sources:
            if rec.units % dp or rec.position.last.layout.identity() != phase.layout.identity():
                raise StateError(
                    f"mixture state source {rec.name!r}: its position is not on the phase's layout "
                    f"{phase.layout.identity()} ({rec.units} units per source-epoch)"
                )
            if rec.name not in self.planners or self._replaced(rec):
                continue
            if rec.version != self.versions[rec.name]:
                changed = ranges_changed(rec.version, self.versions[rec.name])
                if changed is not None:
                    raise StateError(f"mixture source {rec.name!r}: {changed}")
                raise StateError(
                    f"source {rec.name!r} is another dataset than the loader state's: found version "
                    f"{self.versions[rec.name]!r} at {self._url(rec.name)!r}, expected {rec.version!r} "
                    f"(the state's, saved on {self._saved_url(state, rec.name)}). "
                    "A changed dataset cannot continue a position in another's plan; to start it from its "
                    f"beginning, list it in the mixture's replace (replace: [{rec.name!r}]) or give it a new name"
                )
            self.planners[rec.name].check(rec.position)
        same = (
            not any(self._replaced(rec) for rec in phase.sources)
            and phase.names == self.mixture.names
            and phase.schedule == self.mixture.schedule_identity()
            and phase.layout.identity() == self.layout.identity()
            and phase.rows == self.rows
        )
        if same:
            for rec in phase.sources:
                fresh = self._record(rec.name, rec.position)
                if (rec.tokens, rec.units) != (fresh.tokens, fresh.units):
                    raise StateError(
                        f"mixture state source {rec.name!r} has {rec.tokens} tokens in {rec.units} units "
                        "per source-epoch where this dataset and config give another count: found a "
                        "state of another planner or config"
                    )
            return replace(state, about=self.about)
        comp = self.composition(phase)
        counts = comp.counts_at(phase.units_taken(state.step, comp.units))
        old = {rec.name: (rec, c) for rec, c in zip(phase.sources, counts) if not self._replaced(rec)}
        records = []
        for n in self.mixture.names:
            planner = self.planners[n]
            if n in old:
                rec, used = old[n]
                position = planner.continue_on(self.position(rec, phase.layout, used), self.layout)
            else:
                position = planner.start(0, self.versions[n], self.layout)
            records.append(self._record(n, position))
        # Skips still ahead go on in the new phase: from their step, the data moves as far ahead.
        ahead = tuple(k for k in phase.skipped if k[0] >= state.step)
        new = Phase(state.step, self.mixture.schedule_identity(), self.layout, records, ahead, self.rows)
        return MixtureState(state.step, self.fingerprint, new, state.phases_before + 1, about=self.about)

    def _replaced(self, rec: SourceRecord) -> bool:
        """A source the mixture says was replaced (``replace``) that reads another dataset than
        the state's record of that name: it starts from its beginning."""
        return rec.name in self.mixture.replace and rec.name in self.versions and rec.version != self.versions[rec.name]

    def _url(self, name: str) -> str:
        return self.mixture.sources[self.mixture.names.index(name)].url

    @staticmethod
    def _saved_url(state: MixtureState, name: str) -> str:
        url = ((state.about or {}).get("sources") or {}).get(name)
        return repr(url) if url else f"a URL the state does not name ({NO_DESCRIPTION})"

    def composition(self, phase: Phase) -> Composition:
        """The phase's units per step (from the state alone: its schedule and recorded tokens/units)."""
        hit = self._compositions.get(id(phase))
        if hit is not None and hit[0] is phase:
            return hit[1]
        tokens = [r.tokens for r in phase.sources]
        units = [r.units for r in phase.sources]
        entries = [(step, integer_shares(weights, tokens, units)) for step, weights in phase.entries()]
        # The units each run step takes (`comp.units`): the phase's recorded rows by step, else one size.
        comp = Composition(entries, StepUnits(phase.rows) if phase.rows else self.units_per_step)
        self._compositions = {id(phase): (phase, comp)}
        return comp

    # ------------------------------------------------------------------ where a source is
    @staticmethod
    def cursor(rec: SourceRecord, layout: DataLayout) -> tuple[int, int, int]:
        """(units left in the starting epoch, their first index, units per later epoch) per DP rank."""
        last = rec.position.last
        return last.left, last.served, rec.units // layout.dp_size

    def locate(self, rec: SourceRecord, layout: DataLayout, used: int) -> tuple[int, int]:
        """(source-epoch, unit index in the rank's plan of it) of the unit after ``used`` since the phase start."""
        head, first, per_epoch = self.cursor(rec, layout)
        if used < head:
            return rec.epoch, first + used
        later = used - head
        return rec.epoch + 1 + later // per_epoch, later % per_epoch

    def position(self, rec: SourceRecord, layout: DataLayout, used: int) -> LoaderState:
        """The source's single-dataset state after ``used`` units since the phase start (``layout``: the phase's)."""
        head, first, per_epoch = self.cursor(rec, layout)
        if used < head:
            return rec.position.with_served(first + used)
        epoch, index = self.locate(rec, layout, used)
        return LoaderState.start(epoch, rec.version, self.planners[rec.name].batching, layout, per_epoch).with_served(
            index
        )

    def pieces(self, rec: SourceRecord, layout: DataLayout, used: int, count: int) -> list[Piece]:
        """Units ``used .. used + count`` since the phase start, as runs within source-epochs."""
        head, _, per_epoch = self.cursor(rec, layout)
        out: list[Piece] = []
        while count > 0:
            epoch, index = self.locate(rec, layout, used)
            room = head - used if used < head else per_epoch - index
            take = min(count, room)
            out.append((epoch, index, take))
            used, count = used + take, count - take
        return out

    def step_pieces(self, state: MixtureState, step: int) -> list[tuple[str, list[Piece]]]:
        """Step ``step``'s units of every source that has some, in source order."""
        phase = state.phase
        comp = self.composition(phase)
        first = phase.units_from(step, comp.units)  # past the steps skipped
        before, after = comp.counts_at(first), comp.counts_at(first + comp.units.at(step))
        return [
            (rec.name, self.pieces(rec, phase.layout, b, a - b))
            for rec, b, a in zip(phase.sources, before, after)
            if a > b
        ]

    def rank_plan(self, state: MixtureState, name: str, epoch: int, dp_rank: int) -> RankPlan:
        """DP rank ``dp_rank``'s units of source ``name`` in ``epoch`` (the phase's starting epoch:
        its current segment; a later one: planned afresh on the phase's layout)."""
        rec = state.phase.sources[state.phase.names.index(name)]
        planner = self.planners[name]
        if epoch == rec.epoch:
            return planner.rank_plan(rec.position, dp_rank)
        return planner.rank_plan(planner.start(epoch, rec.version, state.phase.layout), dp_rank)

    def positions(self, state: MixtureState) -> dict[str, LoaderState]:
        """The single-dataset state at ``state.step`` of every source of the phase still in the mixture."""
        phase = state.phase
        comp = self.composition(phase)
        counts = comp.counts_at(phase.units_taken(state.step, comp.units))
        return {
            rec.name: self.position(rec, phase.layout, c)
            for rec, c in zip(phase.sources, counts)
            if rec.name in self.planners
        }
