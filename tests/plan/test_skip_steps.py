"""Skipped steps (`LoaderState.skipping`, issue 36 item 3): the batches of the skipped steps are
never served, every other batch of the epoch is served once, the steps go on counting, also
across resumes on other layouts (the skip travels in the state); the state round-trips."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from helpers.strategies import LAYOUTS, datasets
from shardtool.plan import ArraySource, Batching, DataLayout, Layout, LoaderState, Planner, StateError
from shardtool.plan.packing import Packing

DATASET = "manifest-sha-skip"


def _key(plan, b: int) -> tuple:
    """What batch ``b`` of ``plan`` serves: its ids, or (packed) its pieces (a document split
    over rows is in several batches, each with its own piece)."""
    if plan.rows is None:
        return tuple(plan.batch(b).tolist())
    rows = plan.batch_rows(b)
    return tuple(zip(rows.span_pos.tolist(), rows.span_start.tolist(), rows.span_len.tolist()))


def _serve(planner, state, steps):
    """Every DP rank of the state's current layout serves its next ``steps`` steps: (state after,
    the batches served as tuples of ids)."""
    layout = state.last.layout
    positions = state.last.unserved()[:steps]
    got = []
    for d in range(layout.dp_size):
        plan = planner.rank_plan(state, d)
        got += [_key(plan, int(p)) for p in positions]
    if positions.size:
        state = state.with_served(int(positions[-1]) + 1)
    return state, got


@settings(max_examples=300, deadline=None)
@given(
    data=datasets(min_size=40, max_size=500),
    before=st.sampled_from(LAYOUTS),
    after=st.sampled_from(LAYOUTS),
    packed=st.booleans(),
    draw=st.data(),
)
def test_skipped_batches_are_never_served_and_the_rest_once(data, before, after, packed, draw):
    batching = (
        # exact: a re-deal leaves no batch over (`left_over` lists ids, not a packed batch's pieces)
        Batching(batch_size=2, packing=Packing(64), seed=draw.draw(st.integers(0, 3)), exact=True)
        if packed
        else Batching(batch_size=draw.draw(st.integers(1, 6)), seed=draw.draw(st.integers(0, 3)))
    )
    source = ArraySource(data.lengths, data.shard_counts)
    planner = Planner(source, batching)
    try:
        state = planner.start(0, DATASET, DataLayout.pure_dp(before))
    except ValueError as e:
        assert "too small" in str(e)
        return
    n = state.last.batches
    every = [_key(p, b) for d in range(before.world_size) for p in [planner.rank_plan(state, d)] for b in range(n)]
    state, served = _serve(planner, state, draw.draw(st.integers(0, n)))
    steps_in_epoch = state.served - state.last.delivered + state.last.steps
    if state.served >= steps_in_epoch:
        return
    first = draw.draw(st.integers(state.served, steps_in_epoch - 1))
    stop = draw.draw(st.integers(first + 1, steps_in_epoch))
    skipping = state.skipping(first, stop)
    assert skipping.served == state.served and skipping.last.steps == state.last.steps - (stop - first)
    positions = state.last.unserved()[first - state.served : stop - state.served]
    skipped = [
        _key(p, int(b)) for d in range(before.world_size) for p in [planner.rank_plan(state, d)] for b in positions
    ]
    state = LoaderState.from_dict(skipping.to_dict())  # through the saved form
    state, more = _serve(planner, state, draw.draw(st.integers(0, n)))
    served += more
    state = planner.continue_on(state, DataLayout.pure_dp(after))
    planner.check(state)
    state, rest = _serve(planner, state, 10**9)
    served += rest
    left = [tuple(b.tolist()) for b in planner.left_over(state)]
    event("checked")
    served = [b for b in served if b]  # an exact plan's padding batches serve nothing
    skipped = [b for b in skipped if b]
    assert not set(served) & set(skipped)
    assert sorted(served + skipped + left) == sorted(b for b in every if b)  # nothing twice, nothing lost


def test_steps_count_on_and_positions_move_past_the_skip():
    layout = DataLayout.pure_dp(Layout(1, 2))
    state = LoaderState.start(0, DATASET, Batching(batch_size=2), layout, 100).with_served(30)
    skipped = state.skipping(35, 40)
    seg = skipped.last
    assert seg.skipped == ((35, 40),) and seg.steps == 95 and seg.left == 65
    assert seg.position_of(34) == 34 and seg.position_of(35) == 40
    at = skipped.with_served(35)  # the step before the skip served: the position jumps past it
    assert at.last.served == 40 and at.served == 35
    again = skipped.skipping(36, 38)  # steps 36, 37 are positions 41, 42 now
    assert again.last.skipped == ((35, 40), (41, 43)) and LoaderState.from_dict(again.to_dict()).last == again.last


def test_only_steps_not_yet_served_can_be_skipped():
    layout = DataLayout.pure_dp(Layout(1, 1))
    state = LoaderState.start(0, DATASET, Batching(batch_size=2), layout, 50).with_served(30)
    for first, stop in ((20, 35), (31, 31), (40, 51)):
        with pytest.raises(StateError, match="not yet served"):
            state.skipping(first, stop)
    bad = state.to_dict()
    bad["segments"][0]["skipped"] = [[40, 35]]
    with pytest.raises(StateError, match="sorted, apart"):
        LoaderState.from_dict(bad)
    assert "skipped" not in state.to_dict()["segments"][0]  # states without a skip are as before
    assert np.array_equal(state.last.unserved(), np.arange(30, 50))
