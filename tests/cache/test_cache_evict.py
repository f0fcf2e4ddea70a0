"""The eviction decision is a pure function: property-tested directly."""

from hypothesis import given, settings
from hypothesis import strategies as st

from shardtool.cache.evict import Entry, choose_fit, effective_limit, eviction_order, plan_eviction

entries_st = st.lists(
    st.builds(
        Entry,
        key=st.integers(0, 10_000),
        size=st.integers(0, 1000),
        assigned=st.booleans(),
        last_used=st.floats(0, 1e6, allow_nan=False),
        in_use=st.booleans(),
        protected=st.booleans(),
    ),
    max_size=30,
    unique_by=lambda e: e.key,
)


@settings(max_examples=200, deadline=None)
@given(entries_st, st.integers(0, 40_000), st.integers(0, 5000))
def test_plan_eviction_properties(entries, limit, incoming):
    used = sum(e.size for e in entries)
    victims, shortfall = plan_eviction(entries, used=used, limit=limit, incoming=incoming)
    need = used + incoming - limit
    assert all(not v.in_use and not v.protected for v in victims)
    freed = sum(v.size for v in victims)
    if need <= 0:
        assert victims == [] and shortfall == 0
    elif shortfall:
        assert victims == []
        assert shortfall == need - sum(e.size for e in entries if not e.in_use and not e.protected)
    else:
        assert freed >= need
        assert freed - victims[-1].size < need  # minimal: the last one was needed
        # unassigned before assigned, then least recently used first
        keys = [(v.assigned, v.last_used) for v in victims]
        assert keys == sorted(keys)
        rest = [e for e in eviction_order(entries) if e not in victims]
        if rest:
            assert max(keys) <= (rest[0].assigned, rest[0].last_used)


def test_unassigned_go_first_even_if_recently_used():
    old_mine = Entry("a", 10, assigned=True, last_used=1.0)
    new_other = Entry("b", 10, assigned=False, last_used=99.0)
    busy = Entry("c", 10, assigned=False, last_used=0.0, in_use=True)
    victims, short = plan_eviction([old_mine, new_other, busy], used=30, limit=20, incoming=0)
    assert victims == [new_other] and short == 0


def test_effective_limit_and_fit():
    assert effective_limit(100, 50, max_bytes=None, min_free=None) is None
    assert effective_limit(100, 50, max_bytes=120, min_free=None) == 120
    assert effective_limit(100, 50, max_bytes=500, min_free=30) == 120
    assert choose_fit([(0, 5), (1, 10), (2, 3)], 9) == ([0, 2], [1])
