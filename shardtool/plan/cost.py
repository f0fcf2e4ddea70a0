"""What a batch costs to train on, from its lengths: the compute model of the plan (issue 33).

A step's all-reduce waits for the slowest DP rank, so what has to be equal across ranks is the
compute of their batches, not their tokens. With document masking (``cu_seqlens``, varlen
attention) a packed row's attention grows with the sum of its pieces' squared lengths, while
the linear layers grow with its tokens; a batch costs ``a * tokens + b * sum(piece_len ** 2)``.
An unpacked (bucketed) batch of ``m`` samples padded to ``L`` computes on the padding too:
``a * m * L + b * m * L ** 2``.

From a model shape (``params`` N, ``layers``, ``hidden``): a training step takes about 6 N
FLOPs a token in the linear layers and 6 * layers * hidden * L ** 2 in causal attention over a
piece of L tokens (forward and backward), so ``a = 6 N`` and ``b = 6 * layers * hidden``. Pure:
costs are computed from a plan's lengths, never from data.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .rowsplit import cut_squares

__all__ = [
    "BALANCE_VERSION",
    "PRESETS",
    "CostModel",
    "batch_costs",
    "fit_cost_model",
    "row_costs",
    "run_costs",
    "segment_sums",
    "served_costs",
    "step_balance",
]

# Bumped whenever balancing (`shardtool.plan.costorder`) changes which batch goes where: it is in
# the fingerprint of a balanced config, so a state saved under another rule is refused.
BALANCE_VERSION = 1

# Model shapes by name: params, layers, hidden (Llama's published sizes).
PRESETS: dict[str, dict[str, Any]] = {
    "llama-7b": {"params": 7e9, "layers": 32, "hidden": 4096},
    "llama-13b": {"params": 13e9, "layers": 40, "hidden": 5120},
    "llama-70b": {"params": 70e9, "layers": 80, "hidden": 8192},
    "llama3-8b": {"params": 8e9, "layers": 32, "hidden": 4096},
}


@dataclass(frozen=True)
class CostModel:
    """``a * tokens + b * sum(piece_len ** 2)`` (see the module docstring), in FLOPs or any unit."""

    a: float
    b: float

    def __post_init__(self) -> None:
        for name in ("a", "b"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not np.isfinite(v) or v < 0:
                raise ValueError(f"cost model {name} must be a finite number >= 0, found {v!r}")
        if self.a == 0 and self.b == 0:
            raise ValueError("cost model: a and b are both 0, so every batch would cost nothing")

    @classmethod
    def from_shape(cls, params: float, layers: float, hidden: float) -> CostModel:
        """6 N a token for the linear layers, 6 * layers * hidden * L ** 2 for a piece's attention."""
        for name, v in (("params", params), ("layers", layers), ("hidden", hidden)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"cost model {name} must be a number > 0, found {v!r}")
        return cls(6.0 * float(params), 6.0 * float(layers) * float(hidden))

    @classmethod
    def parse(cls, spec: Any) -> CostModel:
        """A CostModel from what users write: a preset name (``"llama-7b"``), a model shape
        (``"params=7e9,layers=32,hidden=4096"`` or that dict), measured coefficients
        (``"a=...,b=..."`` or that dict), or a CostModel."""
        if isinstance(spec, CostModel):
            return spec
        if isinstance(spec, str):
            if spec.strip().lower() in PRESETS:
                return cls.from_shape(**PRESETS[spec.strip().lower()])
            spec = _pairs(spec)
        if not isinstance(spec, Mapping):
            raise ValueError(f"a cost model is a preset name, a model shape or a and b; found {spec!r}")
        spec = {str(k).strip().lower(): v for k, v in spec.items()}  # as the command line's pairs
        keys = set(spec)
        if keys == {"a", "b"}:
            return cls(_number(spec, "a"), _number(spec, "b"))
        if keys == {"params", "layers", "hidden"}:
            whole = {k: _number(spec, k, whole=k != "params") for k in ("params", "layers", "hidden")}
            return cls.from_shape(whole["params"], whole["layers"], whole["hidden"])
        raise ValueError(
            f"cost model {dict(spec)!r}: give params, layers and hidden (a model shape), or a and b "
            f"(measured), or one of the presets {sorted(PRESETS)}"
        )

    def describe(self) -> str:
        return f"{self.a:.4g} x tokens + {self.b:.4g} x sum(piece length^2)"


def _number(spec: Mapping[str, Any], name: str, *, whole: bool = False) -> float:
    """``spec[name]`` as a number (a string of one too, from the command line): ValueError naming
    the spec and the value as given; ``whole``: a whole number (layers, hidden), never truncated."""
    value = spec[name]
    try:
        if isinstance(value, bool):
            raise ValueError
        number = float(value)
        if whole and not number.is_integer():
            raise ValueError
    except (TypeError, ValueError):
        kind = "a whole number" if whole else "a number"
        raise ValueError(f"cost model {dict(spec)!r}: {name} must be {kind}, found {value!r}") from None
    return number


def _pairs(text: str) -> dict[str, str]:
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ValueError(
                f"cost model {text!r}: expected name=value pairs (params=7e9,layers=32,hidden=4096 or a=...,b=...) "
                f"or one of the presets {sorted(PRESETS)}"
            )
        out[key.strip().lower()] = value.strip()
    return out


def segment_sums(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per-segment sums of ``values`` cut at ``offsets`` (empty segments sum to 0), in the values'
    dtype: segment q is ``values[offsets[q] : offsets[q + 1]]``."""
    values = np.asarray(values)
    total = np.zeros(len(values) + 1, values.dtype)
    np.cumsum(values, out=total[1:])
    offsets = np.asarray(offsets, dtype=np.int64)
    return total[offsets[1:]] - total[offsets[:-1]]


def row_costs(rows: Any, model: CostModel) -> np.ndarray:
    """The cost of each packed row (a `shardtool.plan.packing.Rows`): ``seq_len`` tokens (the
    linear layers run on a row's padding too) and its pieces' squares."""
    sq = rows.span_len.astype(np.float64) ** 2
    return model.a * rows.seq_len + model.b * segment_sums(sq, rows.row_offsets)


def run_costs(lengths: np.ndarray, offsets: np.ndarray, model: CostModel) -> np.ndarray:
    """The cost of each unpacked batch ``lengths[offsets[q] : offsets[q + 1]]``, padded to its
    longest sample (attention runs over the padding too)."""
    sizes = np.diff(offsets)
    longest = np.zeros(len(sizes), np.float64)
    full = sizes > 0
    if lengths.size:
        longest[full] = np.maximum.reduceat(np.maximum(lengths, 1), offsets[:-1][full])
    return sizes * (model.a * longest + model.b * longest**2)


def batch_costs(
    plan: Any, model: CostModel, rows_per_batch: int | None = None, seq_lens: np.ndarray | None = None
) -> np.ndarray:
    """The cost of each batch of a group's plan (`shardtool.plan.group.GroupPlan`), as a
    ``[DP ranks of the group, batches per rank]`` array: row j is local DP rank j's batches in
    the order it serves them. Packed plans count every row of ``seq_len`` tokens a batch holds
    (``rows_per_batch`` rows: padding rows run the linear layers too) and each piece's square;
    under a sequence-length warmup, ``seq_lens`` (one per batch of a rank) cuts each batch's rows."""
    k, n = plan.size, plan.batches_per_rank
    lengths = plan.batch_lengths(plan.ids) if plan.rows is None else None
    cut = width = None
    if seq_lens is not None and plan.rows is not None:
        # Batches past the ranks' (none served) keep the planned length.
        cut = np.full(len(plan.row_offsets) - 1, plan.rows.seq_len, np.int64)
        cut[: k * n] = np.tile(np.asarray(seq_lens, np.int64), k)
        planned = rows_per_batch if rows_per_batch is not None else np.diff(plan.row_offsets)
        width = planned * plan.rows.seq_len // cut  # the rows served, each of its batch's seq_len
    served = served_costs(
        plan.rows, plan.row_offsets, lengths, plan.offsets, model, width if width is not None else rows_per_batch, cut
    )
    return served[: k * n].reshape(k, n)


def served_costs(
    rows: Any,
    row_offsets: np.ndarray | None,
    lengths: np.ndarray | None,
    offsets: np.ndarray,
    model: CostModel,
    rows_per_batch: int | np.ndarray | None = None,
    seq_lens: np.ndarray | None = None,
) -> np.ndarray:
    """The cost of each batch a plan serves: packed, batch q's rows ``row_offsets[q] :
    row_offsets[q + 1]`` of ``rows`` (every one of ``rows_per_batch`` rows counted, one number
    or one per batch: padding rows run the linear layers too); else batch q's samples, ``lengths[offsets[q] :
    offsets[q + 1]]``. A group's plan (`batch_costs`) and a rank's (``RankPlan``) alike. Under a
    sequence-length warmup each batch's rows are served cut to ``seq_lens[q]``
    (`shardtool.plan.rowsplit.cut_rows`): the cut pieces' squares, and ``rows_per_batch`` rows
    of ``seq_lens[q]`` tokens (the rows as served)."""
    if rows is not None:
        served = rows_per_batch if rows_per_batch is not None else np.diff(row_offsets)
        width = served * (rows.seq_len if seq_lens is None else np.asarray(seq_lens, np.int64)[: len(row_offsets) - 1])
        if seq_lens is None:
            squares = segment_sums(row_costs(rows, model) - model.a * rows.seq_len, row_offsets)
        else:
            squares = np.zeros(len(row_offsets) - 1, np.float64)  # batches past seq_lens: none served
            cut = model.b * cut_squares(rows, row_offsets, seq_lens)[: squares.size]
            squares[: cut.size] = cut
        cost = model.a * width + squares
    else:
        cost = run_costs(lengths, offsets, model)
    return np.asarray(cost, np.float64)


def step_balance(costs: np.ndarray, micro: int = 1) -> dict[str, float] | None:
    """How evenly the steps load the DP ranks, from ``costs`` [DP ranks, batches]: the per-step
    max/mean across ranks (median, p90, max) and the share of step time lost waiting for the
    slowest rank, ``1 - sum(mean) / sum(max)`` (a step lasts as long as its slowest rank). A step
    is ``micro`` consecutive batches of a rank (gradient accumulation). None without a step.

    ``time_lost_floor`` is the least any order of the same batches can lose: the epoch lasts at
    least as long as the costliest rank's total, ``1 - mean(totals) / max(totals)``. Where the
    loss is at its floor, no step order does better; what is left is what each rank's share
    holds (across nodes: which documents each node's range has)."""
    costs = np.asarray(costs, np.float64)
    if micro > 1 and costs.ndim == 2 and costs.shape[1]:
        costs = np.add.reduceat(costs, np.arange(0, costs.shape[1], micro), axis=1)
    if costs.ndim != 2 or costs.shape[1] == 0 or costs.shape[0] == 0:
        return None
    top, mean, totals = costs.max(axis=0), costs.mean(axis=0), costs.sum(axis=1)
    ratio = np.divide(top, mean, out=np.ones_like(top), where=mean > 0)
    return {
        "max_over_mean_median": float(np.median(ratio)),
        "max_over_mean_p90": float(np.quantile(ratio, 0.9)),
        "max_over_mean_max": float(ratio.max()),
        "time_lost": float(1.0 - mean.sum() / top.sum()) if top.sum() > 0 else 0.0,
        "time_lost_floor": float(1.0 - totals.mean() / totals.max()) if totals.max() > 0 else 0.0,
        "dp_ranks": int(costs.shape[0]),
        "steps": int(costs.shape[1]),
    }


def fit_cost_model(tokens, squares, seconds) -> tuple[CostModel, float]:
    """(a, b) fitted to measured step times — ``seconds[i] ~ a * tokens[i] + b * squares[i]``,
    least squares with a, b >= 0 — and the correlation of the fit's predictions with the times.
    ``tokens`` and ``squares`` are each timed batch's tokens and sum of squared piece lengths
    (`shardtool.loader.packed.cost_terms` of a packed batch): time a few batches of the real
    model (forward and backward, after a warm-up), chosen across the range of their squares, to
    calibrate. A correlation of 0: the fit predicts one cost for all (their squares too alike)."""
    x = np.column_stack([np.asarray(tokens, np.float64), np.asarray(squares, np.float64)])
    y = np.asarray(seconds, np.float64)
    if x.shape[0] < 2 or y.shape != (x.shape[0],) or not np.isfinite(x).all() or not np.isfinite(y).all():
        raise ValueError("fit_cost_model needs at least two timed batches: tokens, squares and seconds of each")
    best = None
    # Non-negative least squares over two coefficients: the unconstrained fit, or either one alone.
    candidates: list[np.ndarray] = [np.asarray(np.linalg.lstsq(x, y, rcond=None)[0], np.float64)]
    for j in (0, 1):
        col = x[:, j]
        one = np.zeros(2)
        one[j] = float(col @ y / (col @ col)) if col @ col > 0 else 0.0
        candidates.append(one)
    for coef in candidates:
        if (coef >= 0).all() and coef.any():
            err = float(((x @ coef - y) ** 2).sum())
            if best is None or err < best[0]:
                best = (err, coef)
    if best is None:
        raise ValueError("fit_cost_model: the times do not grow with tokens or squared lengths")
    coef = best[1]
    pred = x @ coef
    # A fit that predicts one cost for every batch (b = 0 on batches of equal tokens) explains
    # nothing: correlation 0, not the float noise of a constant's.
    varies = pred.std() > 1e-9 * abs(pred.mean()) and y.std() > 0
    corr = float(np.corrcoef(pred, y)[0, 1]) if varies else 0.0
    return CostModel(float(coef[0]), float(coef[1])), corr
