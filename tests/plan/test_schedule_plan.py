"""The plan's side of a batch-size schedule (shardtool/plan/schedule.py): runs of like-length
batches dealt to a rank together, and the run's step recorded in a state."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardtool.plan import Batching, LoaderState
from shardtool.plan.balance import deal_order
from shardtool.plan.packing import Packing
from shardtool.plan.schedule import parse_schedule, parse_schedule_text, with_runs
from shardtool.plan.state import StateError


@settings(max_examples=300, deadline=None)
@given(per_rank=st.integers(0, 40), group=st.integers(1, 5), runs=st.integers(1, 9))
def test_a_run_deal_gives_each_rank_whole_runs_of_neighbours(per_rank, group, runs):
    order = deal_order(per_rank, group, runs)
    assert sorted(order.tolist()) == list(range(per_rank * group))  # every batch to one rank
    ranks = order.reshape(group, per_rank) if per_rank else np.zeros((group, 0), np.int64)
    whole = per_rank // runs
    for j, mine in enumerate(ranks):
        for r in range(whole):  # the rank's r-th run: neighbours, in order
            run = mine[r * runs : (r + 1) * runs]
            assert np.array_equal(run, run[0] + np.arange(runs)) and run[0] % runs == 0
    if runs == 1:
        assert np.array_equal(order, deal_order(per_rank, group))


def test_runs_apply_to_sorted_shuffled_batches_only():
    s = parse_schedule("batch_size", {0: 4, 100: 8, 300: 16})
    assert s.base == 4 and s.run_batches == 16
    assert with_runs(Batching(batch_size=4), s).run_batches == 16
    assert with_runs(Batching(batch_size=4), None).run_batches is None
    assert with_runs(Batching(batch_size=4, shuffle=False), s).run_batches is None
    assert with_runs(Batching(batch_size=4, bucketing=False), s).run_batches is None
    packed = Batching(batch_size=4, packing=Packing(256))
    assert with_runs(packed, s) is packed
    # Unset, a config keeps the fingerprint (and saved states) it had before runs existed.
    assert Batching(batch_size=4, run_batches=None).fingerprint() == Batching(batch_size=4).fingerprint()
    assert Batching(batch_size=4, run_batches=16).fingerprint() != Batching(batch_size=4).fingerprint()
    with pytest.raises(ValueError, match="run_batches"):
        Batching(batch_size=4, packing=Packing(256), run_batches=4)


def test_schedule_text_and_phases():
    assert parse_schedule_text("8") == 8
    s = parse_schedule_text("0:2,5:4,12:8")
    assert s.changes == ((0, 2), (5, 4), (12, 8))
    # 40 planned batches from step 0: 5 steps of 1, 7 of 2, then 8 of 4 but the last of 2.
    assert [(p["size"], p["steps"], p["batches"]) for p in s.phases(0, 40)] == [(2, 5, 5), (4, 7, 14), (8, 6, 21)]
    assert s.epoch_first_step(2, 40) == 18 + s.steps(18, 40)
    with pytest.raises(ValueError):
        parse_schedule_text("0:2,x:4")


def test_a_state_keeps_the_runs_step():
    from shardtool.plan import DataLayout

    st_ = LoaderState.start(1, "fp", Batching(batch_size=2), DataLayout(1, (1,), ((0,),)), 10)
    st_.step = 123
    back = LoaderState.from_dict(st_.to_dict())
    assert back.step == 123 and back.copy().step == 123
    plain = LoaderState.start(1, "fp", Batching(batch_size=2), DataLayout(1, (1,), ((0,),)), 10)
    assert "step" not in plain.to_dict() and LoaderState.from_dict(plain.to_dict()).step is None
    bad = {**st_.to_dict(), "step": -1}
    with pytest.raises(StateError, match="step"):
        LoaderState.from_dict(bad)
