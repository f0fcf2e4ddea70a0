"""What a span of mixture steps takes from each source: shares, tokens, source-epochs; max_repeat.

All closed form from the state (the composition's counts and each source's expected tokens per
unit), so `shardtool plan` reports a billion steps as cheaply as ten, and a loader refuses a
span that would pass over a source more than ``max_repeat`` times before reading anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from .config import MixtureError
from .planner import MixturePlanner
from .state import MixtureState, SourceRecord

__all__ = ["RepeatError", "SourceSpan", "check_repeat", "span", "steps_for_tokens"]


class RepeatError(MixtureError):
    """A span would take more source-epochs of some source than the mixture's max_repeat."""


@dataclass(frozen=True)
class SourceSpan:
    name: str
    weight_share: float  # the schedule's token share over the span
    realized_share: float  # the composition's share of the expected tokens over the span
    units: int  # units every DP rank takes over the span
    tokens: float  # expected tokens over the span, all DP ranks
    tokens_per_epoch: int  # tokens of one source-epoch
    epochs: float  # source-epochs taken from the run's start to the span's end
    epochs_touched: int  # source-epochs begun by the span's end (what max_repeat bounds)


def _epochs(planner: MixturePlanner, rec: SourceRecord, layout, used: int) -> tuple[float, int]:
    head, _, per_epoch = planner.cursor(rec, layout)
    if used <= head:
        passes = rec.epoch + max(1 - (head - used) / per_epoch, 0.0)
    else:
        passes = rec.epoch + 1 + (used - head) / per_epoch
    if used > 0:
        touched = planner.locate(rec, layout, used - 1)[0] + 1
    else:
        touched = rec.epoch + (1 if any(s.served for s in rec.position.segments) else 0)
    return passes, touched


def span(planner: MixturePlanner, state: MixtureState, end_step: int) -> list[SourceSpan]:
    """Per source of ``state``'s phase: steps ``state.step .. end_step``."""
    phase = state.phase
    layout, dp = phase.layout, phase.layout.dp_size
    comp = planner.composition(phase)
    units = comp.units
    begin = comp.counts_at(phase.units_taken(state.step, units))
    end = comp.counts_at(phase.units_taken(end_step, units))
    tau = [Fraction(r.tokens, r.units) for r in phase.sources]
    got = [(e - b) * dp * t for b, e, t in zip(begin, end, tau)]
    # The schedule's target: per entry, tokens of u units = u dp sum(w) / sum(w / tau), source s's w_s / sum(w) of them.
    target = [Fraction(0)] * len(tau)
    starts = [s for s, _ in phase.entries()] + [None]
    for (first, weights), nxt in zip(phase.entries(), starts[1:]):
        lo, hi = max(first, state.step), end_step if nxt is None else min(nxt, end_step)
        if hi <= lo:
            continue
        per_unit = Fraction(dp) / sum(w / t for w, t in zip(weights, tau) if w)
        target = [acc + (units.before(hi) - units.before(lo)) * per_unit * w for acc, w in zip(target, weights)]
    total_got, total_target = sum(got) or 1, sum(target) or 1
    out = []
    for i, rec in enumerate(phase.sources):
        passes, touched = _epochs(planner, rec, layout, end[i])
        out.append(
            SourceSpan(
                rec.name,
                float(target[i] / total_target),
                float(got[i] / total_got),
                end[i] - begin[i],
                float(got[i]),
                rec.tokens,
                passes,
                touched,
            )
        )
    return out


def check_repeat(planner: MixturePlanner, state: MixtureState, end_step: int) -> list[SourceSpan]:
    """The span's sources; RepeatError with a table if one would exceed ``max_repeat`` source-epochs."""
    spans = span(planner, state, end_step)
    limit = planner.mixture.max_repeat
    over = [s.name for s in spans if s.epochs_touched > limit]
    if over:
        raise RepeatError(
            f"steps {state.step}..{end_step} would pass over {', '.join(map(repr, over))} more than "
            f"max_repeat={limit} times:\n{repeat_table(spans, limit)}\nlower the weights of these "
            "sources, train for fewer steps, or raise max_repeat if repeating them is intended"
        )
    return spans


def repeat_table(spans: list[SourceSpan], limit: int) -> str:
    head = f"  {'source':<16}{'target share':>13}{'tokens needed':>16}{'tokens available':>18}{'epochs needed':>15}"
    lines = [head]
    for s in spans:
        flag = "  > max_repeat" if s.epochs_touched > limit else ""
        lines.append(
            f"  {s.name:<16}{s.weight_share:>13.4f}{s.epochs * s.tokens_per_epoch:>16,.0f}"
            f"{s.tokens_per_epoch:>18,}{s.epochs:>15.2f}{flag}"
        )
    return "\n".join(lines)


def steps_for_tokens(planner: MixturePlanner, state: MixtureState, tokens: int) -> int:
    """The fewest steps from step 0 whose expected tokens (all DP ranks) reach ``tokens``."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens must be an int >= 1, found {tokens!r}")
    phase = state.phase
    comp = planner.composition(phase)
    dp = phase.layout.dp_size
    tau = [Fraction(r.tokens, r.units) for r in phase.sources]

    def expected(step: int) -> Fraction:
        return sum(c * dp * t for c, t in zip(comp.counts_at(phase.units_taken(step, comp.units)), tau))  # type: ignore[return-value]  # no sources: 0

    hi = 1
    while expected(hi) < tokens:
        hi *= 2
    lo = hi // 2
    while lo < hi:  # expected() is non-decreasing in the step
        mid = (lo + hi) // 2
        if expected(mid) >= tokens:
            hi = mid
        else:
            lo = mid + 1
    return max(hi, 1)
