"""Skipping steps of a mixture (issue 36 item 3): the steps go on counting, the data moves past
them. Pure: the planner's units per step, against the same mixture's units without the skip.

Run step t of a phase with a skip (a, b) takes the units the phase would take at t where t < a,
and at t + (b - a) from a on: every source moves as far ahead, and the units of the composition's
steps a .. b - 1 are served at no step. The skip survives a JSON round trip and a resume (a new
phase: new weights or another layout) before it begins.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.mixplans import Served, planner_of
from helpers.strategies import MixtureCase, mixture_cases
from shardtool.plan import Batching, Layout
from shardtool.plan.mixture.compose import StepUnits
from shardtool.plan.mixture.state import MixtureState, Phase
from shardtool.plan.state import StateError


def roundtrip(state: MixtureState) -> MixtureState:
    return MixtureState.from_dict(json.loads(json.dumps(state.to_dict())))


def ids(served: Served, state, step: int, dp: int) -> list:
    return [
        (name, epoch, i, [int(x) for x in sample_ids])
        for name, epoch, i, sample_ids, _ in served.units(state, step, dp)
    ]


@settings(max_examples=40, deadline=None)
@given(case=mixture_cases(packed=False), data=st.data())
def test_a_skipped_span_moves_every_source_ahead_and_serves_none_of_it(case, data):
    planner = planner_of(case.sources(), case.weights, case.batching, case.layout)
    served = Served(planner)
    n = data.draw(st.integers(4, 60), label="steps")
    first = data.draw(st.integers(0, n - 1), label="first")
    stop = data.draw(st.integers(first + 1, n + 20), label="stop")
    resume = data.draw(st.integers(0, first), label="resumed at")
    plain = planner.start()
    skipping = roundtrip(MixtureState(resume, plain.fingerprint, plain.phase.with_skip(first, stop)))
    assert skipping.phase.skipped == ((first, stop),)
    jump = stop - first
    for dp in range(case.layout.world_size):
        for t in range(resume, n):
            want = ids(served, plain, t if t < first else t + jump, dp)
            assert ids(served, skipping, t, dp) == want, (dp, t)
        taken = {(u[0], u[1], u[2]) for t in range(resume, n) for u in ids(served, skipping, t, dp)}
        passed = {(u[0], u[1], u[2]) for t in range(first, stop) for u in ids(served, plain, t, dp)}
        assert not taken & passed  # the skipped span's units: never served

    # Where each source stands after step t: as the plain run after t + jump (from the skip on).
    def where(state):
        return {k: (v.epoch, v.to_dict()["segments"]) for k, v in planner.positions(state).items()}

    for t in range(first + 1, n + 1):
        assert where(skipping.at(t)) == where(plain.at(t + jump)), t


@settings(max_examples=25, deadline=None)
@given(case=mixture_cases(packed=True), data=st.data())
def test_a_skip_ahead_survives_a_resume_with_new_weights_or_another_layout(case, data):
    """Saved before the skip's first step and resumed under other weights (a new phase), the skip
    is carried into the new phase: from its step the data moves as far ahead as it would have."""
    planner = planner_of(case.sources(), case.weights, case.batching, case.layout)
    first = data.draw(st.integers(3, 30), label="first")
    stop = data.draw(st.integers(first + 1, first + 15), label="stop")
    at = data.draw(st.integers(1, first), label="saved at")
    base = planner.start()
    state = roundtrip(MixtureState(at, base.fingerprint, base.phase.with_skip(first, stop)))
    weights = [w * (i + 2) for i, w in enumerate(case.weights)]  # other weights: a new phase
    layout = data.draw(st.sampled_from([case.layout, Layout(case.layout.num_nodes + 1, case.layout.ranks_per_node)]))
    other = planner_of(case.sources(), weights, case.batching, layout)
    resumed = other.resume(state)
    assert resumed.phase is not state.phase and resumed.phase.from_step == at
    assert resumed.phase.skipped == ((first, stop),)
    unskipped = other.resume(MixtureState(at, base.fingerprint, base.phase))
    served = Served(other)
    for dp in range(layout.world_size):
        for t in range(at, first + 10):
            want = ids(served, unskipped, t if t < first else t + stop - first, dp)
            assert ids(served, resumed, t, dp) == want, (dp, t)
    # Resumed past the skip's first step: it is behind, in the positions the new phase starts from.
    later = other.resume(MixtureState(first + 2, base.fingerprint, base.phase.with_skip(first, stop)))
    assert later.phase.skipped == ()
    after = other.resume(MixtureState(stop + 2, base.fingerprint, base.phase))
    assert ids(served, later, first + 2, 0) == ids(served, after, stop + 2, 0)


def test_a_skip_moves_the_data_by_the_units_its_steps_would_have_taken():
    phase = Phase(0, [[0, {"a": "1"}]], None, [], ((5, 9), (12, 14)))  # type: ignore[arg-type]
    one = StepUnits.of(3)  # 3 units a step: the composition's steps are the run's, data moved ahead
    starts = [phase.units_from(t, one) // 3 for t in range(20)]
    assert starts[:5] == [0, 1, 2, 3, 4] and starts[5] == 9 and starts[12] == 18 and starts[19] == 25
    assert set(range(25)) - set(starts) == {5, 6, 7, 8, 16, 17}  # the skipped steps' data
    # Where a state saved at step t continues: a skip that begins at t is still ahead.
    assert [phase.units_taken(t, one) // 3 for t in (0, 5, 6, 12, 13)] == [0, 5, 10, 16, 19]
    ramp = StepUnits(((0, 2), (6, 4), (13, 8)))  # the skipped steps' sizes are what is skipped
    assert phase.units_from(5, ramp) == 5 * 2 + (2 + 4 * 3)  # steps 5..8 held 2, 4, 4, 4 units
    assert phase.units_taken(13, ramp) == ramp.before(13) + 14 + (4 + 8)  # and 12..13 held 4, 8
    assert [phase.units_from(t, ramp) for t in range(20)] == sorted(phase.units_from(t, ramp) for t in range(20))


def test_malformed_skips_in_a_state_are_refused():
    case = MixtureCase((500, 800), (1.0, 2.0), Layout(1, 2), Batching(batch_size=2), 1)
    planner = planner_of(case.sources(), case.weights, case.batching, case.layout)
    start = planner.start()
    good = MixtureState(3, start.fingerprint, start.phase.with_skip(4, 6)).to_dict()
    assert good["phase"]["skipped"] == [[4, 6]]
    assert "skipped" not in start.to_dict()["phase"]  # no skip: the form of before
    for bad in ([[6, 4]], [[4, 6], [2, 3]], [[4]], "4:6", [[True, 6]], []):
        data = json.loads(json.dumps(good))
        data["phase"]["skipped"] = bad
        with pytest.raises(StateError, match="skipped steps"):
            MixtureState.from_dict(data)
