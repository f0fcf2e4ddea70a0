"""What each step of a mixture costs a DP rank under a cost model, from its sources' plans.

Every DP rank takes the same number of units of each source at every step (`planner`), so the
u-th unit of a source is taken at the same step on every rank. Each source's plan is balanced
on its own (`shardtool.plan.costorder`): its u-th unit is of like cost on every rank, so a step's
units, source by source, are too, and so is their sum. No rank needs another's lengths.

A packed mixture's unit is one row of ``seq_len`` tokens; a bucketed mixture's is one batch of
one source, padded to its longest sample (`shardtool.plan.cost.served_costs`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np

from ..cost import CostModel, served_costs
from ..forked import forked_map
from ..rank import RankPlan
from .planner import MixturePlanner
from .state import MixtureState

__all__ = ["StepCosts", "first_epoch_steps", "report_steps", "step_costs", "unit_costs"]


def unit_costs(plan: RankPlan, model: CostModel, seq_len: int | None = None) -> np.ndarray:
    """The cost of each unit of a source's rank plan: a packed source's units are single rows,
    under a sequence-length warmup served cut into rows of ``seq_len``."""
    if plan.rows is None:
        return served_costs(None, None, plan.lengths, plan.offsets, model)
    if seq_len is None:
        return served_costs(plan.rows, plan.row_offsets, None, plan.offsets, model, 1)
    cut = np.full(plan.batches_per_rank, seq_len, np.int64)  # a planned row is served as rows of seq_len
    return served_costs(plan.rows, plan.row_offsets, None, plan.offsets, model, plan.rows.seq_len // seq_len, cut)


def step_costs(
    planner: MixturePlanner,
    state: MixtureState,
    dp_ranks: Sequence[int],
    steps: Iterable[int],
    model: CostModel,
    plan_of: Callable[[str, int, int], RankPlan] | None = None,
    seq_len_at: Callable[[int], int | None] | None = None,
    processes: int = 1,
    cache: dict | None = None,
) -> np.ndarray:
    """``[len(dp_ranks), len(steps)]``: the cost of each of ``steps`` on each DP rank under
    ``state``'s phase, the sum of its units' costs. Which units a step takes is the same on every
    rank, so it is worked out once. ``plan_of(name, epoch, dp_rank)`` gives a rank's plan of a
    source-epoch (default: planned here; a loader passes the plans it keeps). Under a
    sequence-length warmup, ``seq_len_at(step)`` is the length a step's rows are cut to. With
    ``processes`` > 1 the ranks are shared out over forked processes (a report of many groups).
    ``cache``: where a caller asking again and again (a run's metric lines) keeps each
    source-epoch's unit costs."""
    steps = list(steps)
    runs: dict[tuple[str, int, int | None], list[tuple[int, int, int]]] = {}  # (step's place, first unit, units)
    for at, step in enumerate(steps):
        seq_len = seq_len_at(step) if seq_len_at is not None else None
        for name, pieces in planner.step_pieces(state, step):
            for epoch, first, count in pieces:
                runs.setdefault((name, epoch, seq_len), []).append((at, first, count))
    spans = {key: np.asarray(got, np.int64).T for key, got in runs.items()}
    ranks = list(dp_ranks)
    work = (planner, state, spans, len(steps), model, plan_of, cache if cache is not None else {})
    if plan_of is not None or processes <= 1 or len(ranks) <= 1:  # a loader's kept plans live here
        return _rank_costs(work, ranks)
    chunks = [c.tolist() for c in np.array_split(np.asarray(ranks), min(len(ranks), 4 * processes))]
    return np.concatenate(forked_map(_rank_costs, work, chunks, processes))


def _rank_costs(work: tuple, ranks: list[int]) -> np.ndarray:
    """Each of ``ranks``' step costs. Source-epoch by source-epoch, its ranks one after another,
    so that the ranks of one data group reuse the group plan their source's planner keeps (a
    report over several epochs of a source would otherwise plan each again for every rank)."""
    planner, state, spans, steps, model, plan_of, cache = work
    plan = plan_of or (lambda name, epoch, rank: planner.rank_plan(state, name, epoch, rank))
    out = np.zeros((len(ranks), steps), np.float64)
    for (name, epoch, seq_len), (where, lo, count) in spans.items():
        for row, rank in enumerate(ranks):
            total = cache.get((name, epoch, seq_len, rank))
            if total is None:
                total = np.concatenate([[0.0], np.cumsum(unit_costs(plan(name, epoch, rank), model, seq_len))])
                if len(cache) > 64:  # the epochs a run is in now: a source's current and next, a few lengths
                    cache.clear()
                cache[(name, epoch, seq_len, rank)] = total
            np.add.at(out[row], where, total[lo + count] - total[lo])
    return out


def first_epoch_steps(planner: MixturePlanner, state: MixtureState, limit: int) -> int:
    """The steps from ``state.step`` (at most ``limit``, at least 1) in which every source serves
    from the epoch it is in: what a report compares most cheaply, each source planned once."""
    return report_steps(planner, state, limit, passes=1.0)


def report_steps(planner: MixturePlanner, state: MixtureState, limit: int, passes: float = 3.0) -> int:
    """The steps from ``state.step`` (at most ``limit``, at least 1) a report prices: each
    source-epoch they draw from is every group's plan of that source, so they stop before the
    one that would take the samples planned past ``passes`` times the sources' samples (a small
    source drawn many times over is cheap to plan again, a large one is not)."""
    samples = {name: int(p.source.summaries.samples.sum()) for name, p in planner.planners.items()}
    budget = passes * sum(samples.values())
    seen = {(rec.name, rec.epoch) for rec in state.phase.sources if rec.name in samples}
    planned = sum(samples[name] for name, _ in seen)
    for k in range(limit):
        for name, runs in planner.step_pieces(state, state.step + k):
            for epoch, _, _ in runs:
                if (name, epoch) not in seen:
                    seen.add((name, epoch))
                    planned += samples[name]
        if planned > budget:
            return max(k, 1)
    return max(limit, 1)


class StepCosts:
    """A rank's step costs, computed for the steps asked (``costs[a:b]``: a run may have millions
    of steps, and its metric lines ask a few at a time), from the plans ``plan_of`` keeps."""

    def __init__(
        self,
        planner: MixturePlanner,
        state: MixtureState,
        dp_rank: int,
        model: CostModel,
        plan_of: Callable[[str, int], RankPlan],
        seq_len_at: Callable[[int], int | None] | None = None,
    ):
        self.planner, self.state, self.dp_rank, self.model, self.plan_of = planner, state, dp_rank, model, plan_of
        self.seq_len_at = seq_len_at  # a warmup's: the length each step's rows are cut to
        self._units: dict = {}  # each source-epoch's unit costs, kept across metric lines

    def __getitem__(self, steps: slice) -> np.ndarray:
        if not isinstance(steps, slice) or steps.stop is None:
            raise TypeError("step costs are read by a slice with its end: costs[first:stop]")
        span = range(steps.start or 0, steps.stop, steps.step or 1)
        return step_costs(
            self.planner, self.state, [self.dp_rank], span, self.model, self._plan, self.seq_len_at, cache=self._units
        )[0]

    def _plan(self, name: str, epoch: int, dp_rank: int) -> RankPlan:
        return self.plan_of(name, epoch)
