"""Plan-level helpers of the mixture tests: planners over in-memory sources, and what every DP rank
is served step by step (computed from the pure planner, the loader's own source of truth)."""

from __future__ import annotations

import numpy as np

from shardtool.plan import DataLayout
from shardtool.plan.mixture import Mixture
from shardtool.plan.mixture.planner import MixturePlanner


def planner_of(sources: dict, weights, batching, layout, *, schedule=None, max_repeat: int = 10**6) -> MixturePlanner:
    mixture = Mixture({n: (f"/data/{n}", w) for n, w in zip(sources, weights)}, schedule, max_repeat)
    data = layout if isinstance(layout, DataLayout) else DataLayout.pure_dp(layout)
    return MixturePlanner(mixture, sources, {n: f"v-{n}" for n in sources}, batching, data)


class Served:
    """Per step, every DP rank's units: (source, epoch, unit index) and their sample ids and tokens."""

    def __init__(self, planner: MixturePlanner):
        self.planner = planner
        self._plans: dict = {}

    def plan(self, state, name, epoch, dp_rank):
        key = (id(state.phase), name, epoch, dp_rank)
        if key not in self._plans:
            if len(self._plans) > 64:
                self._plans.clear()
            self._plans[key] = self.planner.rank_plan(state, name, epoch, dp_rank)
        return self._plans[key]

    def units(self, state, step: int, dp_rank: int) -> list[tuple[str, int, int, np.ndarray, int]]:
        """(source, epoch, index, sample ids, real tokens) of every unit DP rank ``dp_rank`` takes at ``step``."""
        out = []
        for name, pieces in self.planner.step_pieces(state, step):
            for epoch, first, count in pieces:
                plan = self.plan(state, name, epoch, dp_rank)
                for i in range(first, first + count):
                    if plan.rows is not None:
                        rows = plan.batch_rows(i)
                        out.append((name, epoch, i, rows.span_pos, rows.tokens))
                    else:
                        ids = plan.batch(i)
                        out.append(
                            (name, epoch, i, ids, int(plan.lengths[plan.offsets[i] : plan.offsets[i + 1]].sum()))
                        )
        return out

    def unit_tokens(self, state, name, epoch, dp_rank) -> np.ndarray:
        """Real tokens of every unit of one rank's plan of one source-epoch."""
        key = ("tokens", id(state.phase), name, epoch, dp_rank)
        if key not in self._plans:
            plan = self.plan(state, name, epoch, dp_rank)
            if plan.rows is not None:
                per, bounds = plan.rows.row_tokens(), plan.row_offsets
            else:
                per, bounds = plan.lengths, plan.offsets
            csum = np.concatenate([[0], np.cumsum(per)])
            self._plans[key] = csum[bounds[1:]] - csum[bounds[:-1]]
        return self._plans[key]

    def step_tokens(self, state, steps: range) -> np.ndarray:
        """[steps, sources] real tokens of every step, all DP ranks together."""
        names = list(state.phase.names)
        out = np.zeros((len(steps), len(names)))
        for row, t in enumerate(steps):
            for name, pieces in self.planner.step_pieces(state, t):
                for epoch, first, count in pieces:
                    for d in range(state.phase.layout.dp_size):
                        out[row, names.index(name)] += self.unit_tokens(state, name, epoch, d)[
                            first : first + count
                        ].sum()
        return out


def shares_error(tokens: np.ndarray, weights, window: int) -> tuple[float, float]:
    """(largest |share - target| over the whole span, over every window of ``window`` steps)."""
    target = np.asarray(weights, dtype=np.float64) / np.sum(weights)
    span = np.abs(tokens.sum(0) / tokens.sum() - target).max()
    csum = np.vstack([np.zeros((1, tokens.shape[1])), np.cumsum(tokens, axis=0)])
    win = csum[window:] - csum[:-window]
    worst = np.abs(win / win.sum(1, keepdims=True) - target).max() if len(win) else 0.0
    return float(span), float(worst)
