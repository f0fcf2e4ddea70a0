"""The composition rule: which source every unit of a mixture comes from, as a closed form of the step."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardtool.plan.mixture.compose import Composition, integer_shares, webster_counts

shares = st.lists(st.one_of(st.just(0), st.integers(1, 40), st.integers(1, 10**12)), min_size=1, max_size=6).filter(any)


def arrivals(shares, n):
    """The Webster sequence by brute force: every source's k-th unit at (k - 1/2) / share, sorted."""
    events = sorted((Fraction(2 * k - 1, a), s) for s, a in enumerate(shares) if a for k in range(1, n + 2))
    return [s for _, s in events[:n]]


@settings(max_examples=300, deadline=None)
@given(shares, st.integers(0, 400))
def test_closed_form_counts_equal_the_sorted_arrivals(shares, n):
    seq = arrivals(shares, n)
    assert webster_counts(shares, n) == [seq.count(s) for s in range(len(shares))]


@settings(max_examples=200, deadline=None)
@given(shares, st.integers(0, 2000))
def test_one_more_unit_adds_one_unit_to_one_source(shares, n):
    before, after = webster_counts(shares, n), webster_counts(shares, n + 1)
    diff = [b - a for a, b in zip(before, after)]
    assert sorted(diff) == [0] * (len(shares) - 1) + [1]
    assert all(d == 0 for d, a in zip(diff, shares) if a == 0)


@settings(max_examples=300, deadline=None)
@given(shares, st.integers(0, 10**15))
def test_counts_stay_within_the_divisor_bound_of_the_exact_share(shares, n):
    """After n units, |count_s - n p_s| <= 1/2 + (K/2) p_s + 1/2 (K sources with a share): the
    N-th arrival time is within K/2 of N, and a count within 1/2 of time x p_s (one more at a tie)."""
    total, k = sum(shares), sum(1 for a in shares if a)
    for c, a in zip(webster_counts(shares, n), shares):
        p = Fraction(a, total)
        assert abs(c - n * p) <= 1 + Fraction(k, 2) * p


def test_shares_follow_token_weights_over_tokens_per_unit():
    # web units hold 2x the tokens of code units: equal token weights give code twice the units.
    assert integer_shares([Fraction(1, 2), Fraction(1, 2)], [2000, 1000], [10, 10]) == (1, 2)
    assert integer_shares([Fraction(3, 5), Fraction(0)], [100, 7], [3, 1]) == (1, 0)
    with pytest.raises(ValueError, match="tokens and units > 0"):
        integer_shares([Fraction(1)], [0], [5])


@settings(max_examples=100, deadline=None)
@given(st.lists(shares, min_size=1, max_size=4), st.integers(1, 8), st.data())
def test_a_schedule_restarts_the_rule_with_counts_carried(entries, m, data):
    k = len(entries[0])
    entries = [(e + [1] * k)[:k] if len(e) < k else e[:k] for e in entries]
    entries = [e if any(e) else [1] * k for e in entries]
    starts = sorted(data.draw(st.sets(st.integers(1, 60), min_size=len(entries) - 1, max_size=len(entries) - 1)))
    starts = [0, *starts]
    comp = Composition(list(zip(starts, entries)), m)
    end = starts[-1] + 30
    running = [0] * k
    for step in range(end):
        units = comp.step_units(step)
        assert sum(units) == m and all(u >= 0 for u in units)
        running = [r + u for r, u in zip(running, units)]
        assert comp.counts(step + 1) == running  # closed form = the sum of every step so far
    # Inside entry j, the units since its start are that entry's own Webster sequence.
    for j, first in enumerate(starts):
        stop = starts[j + 1] if j + 1 < len(starts) else end
        got = [b - a for a, b in zip(comp.counts(first), comp.counts(stop))]
        assert got == webster_counts(entries[j], (stop - first) * m)


def test_a_composition_refuses_what_it_cannot_deal():
    with pytest.raises(ValueError, match="increasing"):
        Composition([(0, (1, 1)), (0, (1, 2))], 1)
    with pytest.raises(ValueError, match="at least one > 0"):
        Composition([(0, (0, 0))], 1)
