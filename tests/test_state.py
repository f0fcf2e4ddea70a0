"""Resume by position: exact on the same layout, elastic across layouts."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardtool.plan import Batching, plan_epoch
from shardtool.plan.state import LoaderState, check_compatible, plan_for_state, remaining_subset
from shardtool.plan import Layout
from strategies import LAYOUTS, cases, make_lengths

settings.register_profile("state", max_examples=40, deadline=None)
settings.load_profile("state")

DATASET = "manifest-sha-1234"


def served_by(plan, start: int, stop: int) -> np.ndarray:
    """Ids of batches [start, stop) of every rank."""
    parts = [b for r in range(plan.layout.world_size) for b in plan.rank_batches(r)[start:stop]]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def roundtrip(state: LoaderState) -> LoaderState:
    return LoaderState.from_dict(json.loads(json.dumps(state.to_dict())))


@given(cases(), st.floats(0, 1))
def test_same_layout_resume_yields_exactly_the_uninterrupted_tail(case, where):
    lengths, counts = case.data.lengths, case.data.shard_counts
    plan = plan_epoch(lengths, counts, case.layout, case.batching, case.epoch)
    k = int(where * plan.batches_per_rank)
    state = roundtrip(LoaderState.start(case.epoch, DATASET, case.batching, case.layout).with_served(k))
    check_compatible(state, DATASET, case.batching)
    resumed, start = plan_for_state(lengths, counts, case.layout, case.batching, state)
    assert start == k and resumed.batches_per_rank == plan.batches_per_rank
    for rank in range(case.layout.world_size):
        tail, again = plan.rank_batches(rank, k), resumed.rank_batches(rank, start)
        assert len(tail) == len(again)
        assert all(np.array_equal(a, b) for a, b in zip(tail, again))


@given(cases(), st.lists(st.tuples(st.sampled_from(LAYOUTS), st.floats(0, 1)), min_size=1, max_size=2), st.floats(0, 1))
def test_elastic_resumes_never_repeat_and_cover_the_epoch(case, resumes, where):
    lengths, counts = case.data.lengths, case.data.shard_counts
    plan = plan_epoch(lengths, counts, case.layout, case.batching, case.epoch)
    k = int(where * plan.batches_per_rank)
    state = LoaderState.start(case.epoch, DATASET, case.batching, case.layout).with_served(k)
    served = [served_by(plan, 0, k)]
    for layout, fraction in resumes:
        state = roundtrip(state)
        plan, start = plan_for_state(lengths, counts, layout, case.batching, state)
        state = state.resumed_on(layout)
        stop = start + int(fraction * (plan.batches_per_rank - start))
        served.append(served_by(plan, start, stop))
        state = state.with_served(stop)
        for rank in range(layout.world_size):
            assert len(plan.rank_batches(rank)) == plan.batches_per_rank
    # Finish the epoch on the last layout.
    plan, start = plan_for_state(lengths, counts, state_layout(state), case.batching, state)
    served.append(served_by(plan, start, plan.batches_per_rank))
    everything = np.concatenate(served)
    assert np.unique(everything).size == everything.size, "a sample was served twice"
    assert np.array_equal(np.sort(np.concatenate([everything, plan.remainder])), np.arange(lengths.size))
    after = remaining_subset(lengths, counts, case.batching, case.epoch, state.with_served(plan.batches_per_rank).segments)
    assert np.array_equal(np.flatnonzero(after), plan.remainder)


def state_layout(state: LoaderState) -> Layout:
    last = state.segments[-1]
    return Layout(last["world_size"] // last["ranks_per_node"], last["ranks_per_node"])


@pytest.mark.parametrize("before, after", [((4, 1), (3, 1)), ((1, 2), (2, 4)), ((1, 1), (2, 2)), ((2, 2), (1, 1))])
def test_elastic_resume_examples(before, after):
    lengths = make_lengths(np.random.default_rng(2), 6000, "lognormal")
    counts = np.full(14, 6000 // 14)
    counts[-1] += 6000 - counts.sum()
    batching = Batching(max_tokens=int(lengths.max()) * 4, seed=9)
    first = plan_epoch(lengths, counts, Layout(*before), batching, 4)
    k = first.batches_per_rank // 3
    state = LoaderState.start(4, DATASET, batching, Layout(*before)).with_served(k)
    plan, start = plan_for_state(lengths, counts, Layout(*after), batching, roundtrip(state))
    assert start == 0
    a, b = served_by(first, 0, k), plan.sample_ids
    assert np.intersect1d(a, b).size == 0
    assert np.array_equal(np.sort(np.concatenate([a, b, plan.remainder])), np.arange(lengths.size))
    # After an elastic resume the world still drops less than one batch per rank.
    assert lengths[plan.remainder].sum() < Layout(*after).world_size * batching.max_tokens


def test_resume_at_the_end_of_an_epoch_on_a_bigger_world_plans_nothing():
    lengths = make_lengths(np.random.default_rng(4), 500, "constant")
    batching = Batching(batch_size=8)
    first = plan_epoch(lengths, [500], Layout(1, 1), batching, 0)
    state = LoaderState.start(0, DATASET, batching, Layout(1, 1)).with_served(first.batches_per_rank)
    plan, start = plan_for_state(lengths, [500], Layout(4, 2), batching, state)
    assert (plan.batches_per_rank, start) == (0, 0)
    assert plan.rank_batches(7) == []
    assert np.array_equal(plan.remainder, first.remainder)


def test_state_is_small_and_json_roundtrips():
    batching = Batching(batch_size=4, seed=3)
    state = LoaderState.start(7, DATASET, batching, Layout(2, 4)).with_served(12).resumed_on(Layout(3, 1))
    data = state.to_dict()
    assert data == {
        "version": 1,
        "epoch": 7,
        "dataset_fingerprint": DATASET,
        "batching_fingerprint": batching.fingerprint(),
        "segments": [
            {"world_size": 8, "ranks_per_node": 4, "served": 12},
            {"world_size": 3, "ranks_per_node": 1, "served": 0},
        ],
    }
    assert roundtrip(state) == state
    assert len(json.dumps(data)) < 400
    # Continuing on the same layout adds no segment.
    assert state.resumed_on(Layout(3, 1)) == state


def test_incompatible_states_are_refused_with_found_and_expected():
    batching = Batching(max_tokens=4096)
    state = LoaderState.start(0, DATASET, batching, Layout(1, 1))
    with pytest.raises(ValueError, match=r"found dataset fingerprint 'manifest-sha-1234', expected 'other'"):
        check_compatible(state, "other", batching)
    with pytest.raises(ValueError, match=r"another batching config: found fingerprint"):
        check_compatible(state, DATASET, Batching(max_tokens=8192))
    with pytest.raises(ValueError, match=r"another batching config"):
        plan_for_state(np.ones(10, np.int64), [10], Layout(1, 1), Batching(max_tokens=8192), state)
    state.version = 99
    with pytest.raises(ValueError, match=r"version: found 99, expected 1"):
        check_compatible(state, DATASET, batching)
    bad = {**LoaderState.start(0, DATASET, batching, Layout(1, 1)).to_dict(), "version": 2}
    with pytest.raises(ValueError, match=r"version: found 2, expected 1"):
        LoaderState.from_dict(bad)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"epoch": -1}, "epoch must be an int >= 0"),
        ({"segments": []}, "non-empty list"),
        ({"segments": [{"world_size": 6, "ranks_per_node": 4, "served": 0}]}, "multiple of ranks_per_node"),
        ({"segments": [{"world_size": 2, "served": 0}]}, "expected keys"),
        ({"extra": 1}, "keys: found"),
    ],
)
def test_malformed_state_is_refused(change, message):
    data = {**LoaderState.start(0, DATASET, Batching(batch_size=2), Layout(1, 1)).to_dict(), **change}
    with pytest.raises(ValueError, match=message):
        LoaderState.from_dict(data)


def test_a_position_past_the_plan_is_refused():
    lengths = np.full(100, 10)
    batching = Batching(batch_size=10)
    state = LoaderState.start(0, DATASET, batching, Layout(1, 1)).with_served(11)
    with pytest.raises(ValueError, match="11 batches served per rank, but its plan has only 10"):
        plan_for_state(lengths, [100], Layout(1, 1), batching, state)
