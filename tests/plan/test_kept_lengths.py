"""A plan's lengths read from the loader's construction on (`Planner.expect_lengths`): the plan
waits for that read and asks its source for nothing more; a read that failed is asked again, so
the plan raises the source's own error."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import pytest

from shardtool.plan import ArraySource, Batching, DataLayout, Layout, Planner


class CountingSource(ArraySource):
    def __init__(self, lengths, counts):
        super().__init__(lengths, counts)
        self.reads: list[tuple[int, int]] = []

    def lengths_range(self, lo: int, hi: int) -> np.ndarray:
        self.reads.append((lo, hi))
        return super().lengths_range(lo, hi)


def _planned(source, layout, started):
    planner = Planner(source, Batching(batch_size=4, seed=2))
    state = planner.start(0, "ds", layout)
    planner.expect_lengths(layout, layout.group_of(1)[0], started)
    return planner.rank_plan(state, 1).batches()


def test_the_plan_waits_for_the_lengths_read_ahead_and_reads_nothing_again():
    lengths = np.random.default_rng(0).integers(1, 500, 400)
    layout = DataLayout.pure_dp(Layout(2, 2))  # two groups: the plan reads its own group's range
    asked: list[tuple[int, int]] = []

    def started(lo, hi):
        asked.append((lo, hi))
        done: Future = Future()
        done.set_result(lengths[lo:hi])
        return done

    source = CountingSource(lengths, [100] * 4)
    got = _planned(source, layout, started)
    assert source.reads == [] and len(asked) == 1  # the read ahead, once, and nothing else
    assert [b.tolist() for b in got] == [
        b.tolist() for b in _planned(CountingSource(lengths, [100] * 4), layout, _failed)
    ]


def _failed(lo, hi):
    failed: Future = Future()
    failed.set_exception(OSError("the store went away"))
    return failed


def test_a_failed_read_ahead_is_read_again_by_the_plan_which_raises_the_source_s_error():
    lengths = np.arange(1, 201)
    layout = DataLayout.pure_dp(Layout(1, 2))
    source = CountingSource(lengths, [100, 100])
    _planned(source, layout, _failed)
    assert source.reads == [(0, 200)]  # asked again once the read ahead failed

    class Broken(CountingSource):
        def lengths_range(self, lo: int, hi: int) -> np.ndarray:
            raise OSError("lengths.npy: no such key")

    with pytest.raises(OSError, match="lengths.npy: no such key"):
        _planned(Broken(lengths, [100, 100]), layout, _failed)
