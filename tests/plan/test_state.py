"""Resume by position: exact on the same layout, elastic across data layouts (plan v2)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.strategies import LAYOUTS, cases, make_lengths
from shardtool.plan import ArraySource, Batching, DataLayout, Layout, Planner
from shardtool.plan.packing import Packing
from shardtool.plan.state import LoaderState, Segment, StateError, _v1_fingerprint, check_compatible

settings.register_profile("state", max_examples=40, deadline=None)
settings.load_profile("state")

DATASET = "manifest-sha-1234"


def roundtrip(state: LoaderState) -> LoaderState:
    return LoaderState.from_dict(json.loads(json.dumps(state.to_dict())))


def batches_of(planner: Planner, state: LoaderState, layout: DataLayout) -> list[list[np.ndarray]]:
    """Every DP rank's batches of the state's current segment, each from a fresh planner (as ranks)."""
    return [Planner(planner.source, planner.batching).rank_plan(state, d).batches() for d in range(layout.dp_size)]


def reference_redeal(sequence_per_rank: list[list[np.ndarray]], served: int, new_size: int):
    """The segment rule written out with lists: the unserved batches, rank by rank, cut into equal
    shares for the new ranks; what does not divide evenly is left over."""
    remaining = [b for rank in sequence_per_rank for b in rank[served:]]
    n = len(remaining) // new_size
    return [remaining[d * n : (d + 1) * n] for d in range(new_size)], remaining[n * new_size :]


@given(cases(), st.floats(0, 1))
def test_same_layout_resume_yields_exactly_the_uninterrupted_tail(case, where):
    source = ArraySource(case.data.lengths, case.data.shard_counts)
    planner = Planner(source, case.batching)
    layout = DataLayout.pure_dp(case.layout)
    start = planner.start(case.epoch, DATASET, layout)
    full = batches_of(planner, start, layout)
    k = int(where * start.last.batches)
    state = roundtrip(start.with_served(k))
    check_compatible(state, DATASET, case.batching)
    planner.check(state)
    resumed = planner.continue_on(state, layout)
    assert resumed.last.served == k and len(resumed.segments) == 1
    for d, rank in enumerate(batches_of(planner, resumed, layout)):
        assert all(np.array_equal(a, b) for a, b in zip(rank[k:], full[d][k:])) and len(rank) == len(full[d])


@given(cases(), st.lists(st.tuples(st.sampled_from(LAYOUTS), st.floats(0, 1)), min_size=1, max_size=3), st.floats(0, 1))
def test_elastic_chains_equal_the_written_out_rule_never_repeat_and_cover_the_epoch(case, resumes, where):
    source = ArraySource(case.data.lengths, case.data.shard_counts)
    planner = Planner(source, case.batching)
    layout = DataLayout.pure_dp(case.layout)
    state = planner.start(case.epoch, DATASET, layout)
    # The rule written out: a stack of segments [layout, each rank's batches, served, left over];
    # a resume on another layout drops trailing segments that served nothing, then continues the
    # last one if it ran on that layout, else deals what it did not serve; a state left with no
    # segment plans the epoch afresh.
    stack = [[layout, batches_of(planner, state, layout), int(where * state.last.batches), []]]
    for new, fraction in resumes:
        new_layout = DataLayout.pure_dp(new)
        state = roundtrip(state.with_served(stack[-1][2]))
        planner.check(state)
        if stack[-1][0] != new_layout:
            while stack and stack[-1][2] == 0:
                stack.pop()
            if not stack:
                fresh = planner.start(case.epoch, DATASET, new_layout)
                stack = [[new_layout, batches_of(planner, fresh, new_layout), 0, []]]
            elif stack[-1][0] != new_layout:
                shares, extra = reference_redeal(stack[-1][1], stack[-1][2], new_layout.dp_size)
                assert len(extra) < new_layout.dp_size
                stack.append([new_layout, shares, 0, extra])
        state = planner.continue_on(state, new_layout)
        current = batches_of(planner, state, new_layout)
        assert [[b.tolist() for b in r] for r in current] == [[b.tolist() for b in r] for r in stack[-1][1]]
        assert len({len(r) for r in current}) == 1, "equal counts on every new rank"
        start = stack[-1][2]
        stack[-1][2] = start + int(fraction * (state.last.batches - start))
    state = state.with_served(stack[-1][2])
    # What each segment served, then the last one finished.
    served = [b for _, rank, count, _ in stack[:-1] for r in rank for b in r[:count]]
    served += [b for r in stack[-1][1] for b in r]
    everything = np.concatenate(served) if served else np.zeros(0, np.int64)
    assert np.unique(everything).size == everything.size, "a sample was served twice"
    first = state.segments[0].layout
    remainder = np.unique(
        np.concatenate(
            [planner.rank_plan(planner.start(case.epoch, DATASET, first), d).remainder for d in range(first.dp_size)]
        )
    )
    left_over = [b for entry in stack for b in entry[3]]
    unserved = np.concatenate([remainder, *left_over])
    assert np.array_equal(np.sort(np.concatenate([everything, unserved])), np.arange(case.data.lengths.size))
    assert sorted(b.tolist() for b in planner.left_over(state)) == sorted(b.tolist() for b in left_over)


@pytest.mark.parametrize("before, after", [((4, 1), (3, 1)), ((1, 2), (2, 4)), ((1, 1), (2, 2)), ((2, 2), (1, 1))])
def test_elastic_resume_costs_about_a_ranks_share(before, after):
    lengths = make_lengths(np.random.default_rng(2), 6000, "lognormal")
    counts = np.full(14, 6000 // 14)
    counts[-1] += 6000 - counts.sum()
    batching = Batching(max_tokens=int(lengths.max()) * 4, seed=9)
    old, new = DataLayout.pure_dp(Layout(*before)), DataLayout.pure_dp(Layout(*after))
    planner = Planner(ArraySource(lengths, counts), batching)
    state = planner.start(4, DATASET, old)
    state = planner.continue_on(state.with_served(state.last.batches // 3), new)
    for d in range(new.dp_size):
        mine = ArraySource(lengths, counts)
        plan = Planner(mine, batching).rank_plan(roundtrip(state), d)
        assert plan.batches_per_rank == state.last.batches
        # Its batches are a contiguous run of old ranks' batches: it plans only the few old groups
        # they come from, about old.dp_size / new.dp_size of them, not the whole dataset.
        groups_read = len(set(mine.ranges_read))
        assert groups_read <= -(-old.num_groups // new.dp_size) + 1


def test_resume_at_the_end_of_an_epoch_on_a_bigger_world_serves_nothing():
    lengths = make_lengths(np.random.default_rng(4), 500, "constant")
    planner = Planner(ArraySource(lengths, [500]), Batching(batch_size=8))
    one = DataLayout.pure_dp(Layout(1, 1))
    state = planner.start(0, DATASET, one)
    state = planner.continue_on(state.with_served(state.last.batches), DataLayout.pure_dp(Layout(4, 2)))
    assert state.last.batches == 0
    assert all(planner.rank_plan(state, d).batches() == [] for d in range(8))


def test_a_state_with_nothing_served_restarts_the_epoch_on_the_new_layout():
    lengths = make_lengths(np.random.default_rng(4), 900, "lognormal")
    planner = Planner(ArraySource(lengths, [300, 300, 300]), Batching(batch_size=8))
    old, new = DataLayout.pure_dp(Layout(1, 1)), DataLayout.pure_dp(Layout(3, 1))
    state = planner.continue_on(planner.start(2, DATASET, old), new)
    assert state.segments == planner.start(2, DATASET, new).segments


def test_state_is_small_and_json_roundtrips():
    batching = Batching(batch_size=4, seed=3)
    state = LoaderState.start(7, DATASET, batching, DataLayout.pure_dp(Layout(2, 4)), 30).with_served(12)
    state = state.resumed_on(DataLayout.pure_dp(Layout(3, 1)), 59)
    data = state.to_dict()
    assert data == {
        "version": 2,
        "epoch": 7,
        "dataset_fingerprint": DATASET,
        "batching_fingerprint": batching.fingerprint(),
        "segments": [
            {"dp_size": 8, "groups": [[4, 2]], "batches": 30, "served": 12},
            {"dp_size": 3, "groups": [[1, 3]], "batches": 59, "served": 0},
        ],
    }
    assert roundtrip(state) == state
    assert len(json.dumps(data)) < 400
    big = LoaderState.start(0, DATASET, batching, DataLayout.pure_dp(Layout(1024, 8)), 65)
    assert len(json.dumps(big.to_dict())) < 300, "a 8,192-rank layout is one run of equal groups"
    assert state.resumed_on(DataLayout.pure_dp(Layout(3, 1)), 59) == state


def test_incompatible_states_are_refused_with_found_and_expected():
    batching = Batching(max_tokens=4096)
    planner = Planner(ArraySource(np.ones(100, np.int64), [100]), batching)
    state = planner.start(0, DATASET, DataLayout.pure_dp(Layout(1, 1)))
    # A plan's state names no dataset (the loader adds that): the message says so and quotes the fingerprints.
    with pytest.raises(
        ValueError,
        match=r"found dataset fingerprint 'manifest-sha-1234' \(.*names no URL\), "
        r"expected dataset fingerprint 'other'",
    ):
        check_compatible(state, "other", batching)
    with pytest.raises(
        ValueError,
        match=r"another batching config: found batching fingerprint '\w+' \(.*names no "
        r"settings\), expected \{max_tokens: 8192, shuffle: true, seed: 0",
    ):
        check_compatible(state.with_served(1), DATASET, Batching(max_tokens=8192))  # a position inside the epoch
    # At an epoch's start it holds no position in the old plan: the epoch starts under the new batching.
    other = Batching(max_tokens=8192)
    moved = check_compatible(planner.start(3, DATASET, DataLayout.pure_dp(Layout(1, 1))), DATASET, other)
    assert moved.epoch == 3 and moved.batching_fingerprint == other.fingerprint() and moved.served == 0
    bad = {**state.to_dict(), "version": 3}
    with pytest.raises(ValueError, match=r"version: found 3, expected 2"):
        LoaderState.from_dict(bad)
    wrong = state.copy()
    seg = wrong.segments[0]
    wrong.segments[0] = Segment(seg.layout, seg.batches + 1, seg.served)
    with pytest.raises(StateError, match="from another dataset or config"):
        planner.check(wrong)


def test_a_state_of_the_previous_release_loads_at_an_epoch_start_and_is_refused_mid_epoch():
    batching = Batching(batch_size=4, seed=3)
    v1 = {
        "version": 1,
        "epoch": 3,
        "dataset_fingerprint": DATASET,
        "batching_fingerprint": _v1_fingerprint(batching),
        "segments": [{"world_size": 8, "ranks_per_node": 4, "served": 0}],
    }
    state = LoaderState.from_dict(v1, batching=batching)
    assert state.epoch == 3 and state.segments == [] and state.batching_fingerprint == batching.fingerprint()
    planner = Planner(ArraySource(np.ones(400, np.int64), [400]), batching)
    started = planner.continue_on(state, DataLayout.pure_dp(Layout(2, 2)))
    assert started.segments == planner.start(3, DATASET, DataLayout.pure_dp(Layout(2, 2))).segments
    with pytest.raises(StateError, match=r"another batching config"):
        LoaderState.from_dict(v1, batching=Batching(batch_size=5))
    mid = {**v1, "segments": [{"world_size": 8, "ranks_per_node": 4, "served": 5}]}
    with pytest.raises(StateError, match=r"saved by shardtool 0.1 in the middle of epoch 3.*set_epoch\(3\)"):
        LoaderState.from_dict(mid, batching=batching)


def test_a_mid_epoch_no_split_state_of_an_older_count_is_refused_as_another_plan_version(monkeypatch):
    # No-split's counts changed (2026-12-07): an older position would be replayed against other
    # batches. The refusal names the cause; a state at an epoch's start still loads; other
    # policies' fingerprints (and their saved states) are untouched by no-split's version.
    from shardtool.plan.about import describe
    from shardtool.plan.packing import config

    def batching(policy: str) -> Batching:
        return Batching(batch_size=2, packing=Packing(seq_len=1024, policy=policy), seed=1)

    monkeypatch.setattr(config, "NO_SPLIT_VERSION", config.NO_SPLIT_VERSION - 1)
    old, best_fit_before = batching("no-split").fingerprint(), batching("best-fit").fingerprint()
    monkeypatch.undo()
    assert batching("best-fit").fingerprint() == best_fit_before
    planner = Planner(ArraySource(np.full(400, 300, np.int64), [200, 200]), batching("no-split"))
    layout = DataLayout.pure_dp(Layout(1, 2))
    start = planner.start(2, DATASET, layout)
    about = describe("s3://b/d", "v1", 400, batching("no-split"))
    saved = LoaderState(2, DATASET, old, start.segments, start.version, about, start.step)
    with pytest.raises(StateError, match=r"as here, but by another plan version"):
        check_compatible(saved.with_served(1), DATASET, batching("no-split"), about)
    assert check_compatible(saved, DATASET, batching("no-split"), about).batching_fingerprint != old


@pytest.mark.parametrize(
    "change, message",
    [
        ({"epoch": -1}, "epoch must be an int >= 0"),
        ({"segments": []}, "non-empty list"),
        ({"segments": [{"dp_size": 6, "groups": [[4, 1]], "batches": 3, "served": 0}]}, "do not add up"),
        ({"segments": [{"dp_size": 2, "groups": [[1, 2]], "batches": 3, "served": 4}]}, "served 4 of only 3"),
        ({"segments": [{"dp_size": 2, "served": 0}]}, "expected keys"),
        ({"extra": 1}, "keys: found"),
    ],
)
def test_malformed_state_is_refused(change, message):
    data = {
        **LoaderState.start(0, DATASET, Batching(batch_size=2), DataLayout.pure_dp(Layout(1, 1)), 5).to_dict(),
        **change,
    }
    with pytest.raises(ValueError, match=message):
        LoaderState.from_dict(data)


def test_a_segment_is_typed_its_saved_form_unchanged_and_its_nodes_never_part_of_it():
    on_nodes = DataLayout.pure_dp(Layout(2, 4))
    seg = Segment(on_nodes, 10, 3)
    assert seg.left == 7 and seg.with_served(10).left == 0
    # The saved JSON keeps its form: layout identity, batches, served.
    assert seg.to_dict() == {"dp_size": 8, "groups": [[4, 2]], "batches": 10, "served": 3}
    assert Segment.from_dict(json.loads(json.dumps(seg.to_dict()))) == seg
    # The nodes do not change what a DP rank reads: a segment parsed back equals the one planned.
    assert seg.layout == DataLayout.from_identity(on_nodes.identity())
    state = LoaderState.start(0, DATASET, Batching(batch_size=2), on_nodes, 10).with_served(3)
    assert state.last == seg and LoaderState.from_dict(state.to_dict()).segments == [seg]
    with pytest.raises(StateError, match="served 11 of only 10"):
        seg.with_served(11)
    with pytest.raises(StateError, match="batches must be an int"):
        Segment(on_nodes, True, 0)
