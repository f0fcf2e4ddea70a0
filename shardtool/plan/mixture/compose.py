"""Which source each unit of a mixture comes from: a closed form of the step, no history.

A *unit* is what a mixture hands out one at a time (a whole batch of one source, or one packed
row). Source s gets a share ``p_s`` of the units, proportional to its token weight over its
expected tokens per unit. Units are dealt by the Sainte-Laguë (Webster) divisor rule: the k-th
unit of s "arrives" at time (k - 1/2) / p_s, and the unit sequence is all arrivals in time order,
ties by source order. The rule is house-monotone (one more unit never takes one away from a
source) and, after N units, every source's count is within 1 + (K/2) p_s of its exact share
N p_s (K sources): so over any window of w units a share is within about 2/w of its target.

Counts have a closed form: s-arrivals up to time x number floor(x p_s + 1/2), so the N-th
arrival lies within K/2 of N (K sources); a few candidates around it, sorted, give it exactly.
All in integers (shares are integers ``a_s`` proportional to p_s), so every machine agrees, and
any position costs O(K log K), whatever the step.

A schedule restarts the rule at each entry's first step with the counts carried over, so a
source's cursor only ever moves forward.

Steps may take different numbers of units (a packed mixture whose rows ramp up by step,
`StepUnits`): the rule deals units, not steps, so a position is a count of units, and a step
takes the units from where the steps before it left off. With one size a step this is the
same sequence, cut the same way.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from ..schedule import value_at

__all__ = ["Composition", "StepUnits", "integer_shares", "webster_counts"]


@dataclass(frozen=True)
class StepUnits:
    """Units a step takes, by the run's step: ``changes`` (first step, units), sorted, the first
    at step 0 (a packed mixture's rows by step; one pair: one size)."""

    changes: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, units: int | StepUnits) -> StepUnits:
        return units if isinstance(units, StepUnits) else cls(((0, int(units)),))

    def at(self, step: int) -> int:
        """Units of step ``step``."""
        return value_at(self.changes, step)

    def before(self, step: int) -> int:
        """Units of steps ``0 .. step - 1`` (closed form: a sum over the changes)."""
        total = 0
        for i, (first, units) in enumerate(self.changes):
            if first >= step:
                break
            end = self.changes[i + 1][0] if i + 1 < len(self.changes) else step
            total += (min(end, step) - first) * units
        return total


def integer_shares(weights: Sequence[Fraction], tokens: Sequence[int], units: Sequence[int]) -> tuple[int, ...]:
    """Integer unit shares a_s ∝ w_s / tau_s, tau_s = tokens_s / units_s (expected tokens per
    unit), reduced by their gcd. A source of weight 0 gets share 0."""
    raw = []
    for w, t, u in zip(weights, tokens, units):
        if w and (t <= 0 or u <= 0):
            raise ValueError(f"a source with weight {w} needs tokens and units > 0, found {t} tokens in {u} units")
        raw.append(Fraction(w) * u / t if w else Fraction(0))
    scale = math.lcm(*(q.denominator for q in raw))
    ints = [int(q * scale) for q in raw]
    g = math.gcd(*ints)
    return tuple(i // g for i in ints)


@functools.lru_cache(maxsize=64)
def _scales(shares: tuple[int, ...]) -> tuple[int, ...]:
    lcm = math.lcm(*(a for a in shares if a))
    return tuple(lcm // a if a else 0 for a in shares)


def webster_counts(shares: Sequence[int], n: int) -> list[int]:
    """Units of each source among the first ``n`` units of the Webster sequence of ``shares``."""
    if n <= 0:
        return [0] * len(shares)
    total = sum(shares)
    k = sum(1 for a in shares if a)
    # In time y (arrival of s's j-th unit at (2j - 1) / a_s), count(y) = sum floor((y a_s + 1) / 2)
    # lies in (y A/2 - k/2, y A/2 + k/2]: below y_lo = (2n - k - 1)/A fewer than n units have
    # arrived, by y_hi = (2n + k)/A at least n.
    lo_num, hi_num = 2 * n - k - 1, 2 * n + k
    base = [max((lo_num * a + total) // (2 * total), 0) if a else 0 for a in shares]
    # Arrival (2j - 1) / a_s as the integer (2j - 1) * (L / a_s), L = lcm of the shares: the same
    # order as the fractions, several times cheaper to sort.
    scale = _scales(tuple(shares))
    candidates = []
    for s, a in enumerate(shares):
        if not a:
            continue
        last = (hi_num * a + total) // (2 * total)
        candidates += [((2 * j - 1) * scale[s], s) for j in range(base[s] + 1, last + 1)]
    candidates.sort()
    out = list(base)
    for _, s in candidates[: n - sum(base)]:
        out[s] += 1
    return out


class Composition:
    """The units of every source of one phase: schedule entries ``(first_step, shares)``
    (increasing first steps, the first at the phase's start), ``units`` a step (one size, or
    `StepUnits` by step). Positions are counted in units from the phase's start (`counts_at`);
    `counts` and `step_units` take steps of a run that skipped none."""

    def __init__(self, entries: Sequence[tuple[int, Sequence[int]]], units: int | StepUnits):
        if not entries:
            raise ValueError("a composition needs at least one schedule entry")
        self.starts = [int(s) for s, _ in entries]
        if any(b <= a for a, b in zip(self.starts, self.starts[1:])):
            raise ValueError(f"schedule entries must start at increasing steps, found {self.starts}")
        self.shares = [tuple(int(a) for a in sh) for _, sh in entries]
        if len({len(sh) for sh in self.shares}) != 1 or any(not any(sh) for sh in self.shares):
            raise ValueError("every schedule entry needs a share per source, at least one > 0")
        self.units = StepUnits.of(units)
        self.first_step = self.starts[0]
        # Each entry's first unit, from the phase's start.
        self.first_units = [self.units_before(s) for s in self.starts]
        self._last: dict[int, tuple[int, ...]] = {}
        # Counts at each entry's start, so that a position costs one entry's closed form.
        self._carried = [[0] * len(self.shares[0])]
        for i in range(1, len(self.starts)):
            got = webster_counts(self.shares[i - 1], self.first_units[i] - self.first_units[i - 1])
            self._carried.append([c + g for c, g in zip(self._carried[-1], got)])

    @property
    def num_sources(self) -> int:
        return len(self.shares[0])

    def units_before(self, step: int) -> int:
        """Units of the phase's steps before ``step`` (none skipped)."""
        return self.units.before(step) - self.units.before(self.first_step) if step > self.first_step else 0

    def counts_at(self, n: int) -> list[int]:
        """Units of every source among the phase's first ``n`` units."""
        if n <= 0:
            return [0] * self.num_sources
        hit = self._last.get(n)
        if hit is not None:
            return list(hit)
        i = max(j for j, first in enumerate(self.first_units) if first < n or j == 0)
        got = webster_counts(self.shares[i], n - self.first_units[i])
        out = [c + g for c, g in zip(self._carried[i], got)]
        if len(self._last) >= 4:  # steps come in order: step t's end is step t + 1's start
            self._last.clear()
        self._last[n] = tuple(out)
        return out

    def counts(self, step: int) -> list[int]:
        """Units of every source in steps [first_step, step)."""
        return self.counts_at(self.units_before(step))

    def step_units(self, step: int) -> list[int]:
        """Units of every source in step ``step``."""
        before, after = self.counts(step), self.counts(step + 1)
        return [b - a for a, b in zip(before, after)]

    def entry_at(self, step: int) -> int:
        """Index of the schedule entry step ``step`` is in."""
        return max((j for j, s in enumerate(self.starts) if s <= step), default=0)
