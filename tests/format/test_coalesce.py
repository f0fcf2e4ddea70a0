"""Coalescing a shard's byte ranges into fewer reads (issue 38: requests bounded): every range
comes back exactly, each read is one run, and neighbours within the gap share a read."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardtool.format.coalesce import DEFAULT_GAP, GAP_ENV, coalesce, gap_from_env, read_coalesced

ranges = st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 400)), min_size=1, max_size=40)


@settings(max_examples=300, deadline=None)
@given(ranges=ranges, gap=st.one_of(st.none(), st.integers(0, 600)), cap=st.integers(1, 3000))
def test_every_range_is_read_exactly_and_runs_join_only_neighbours(ranges, gap, cap):
    blob = np.random.default_rng(0).integers(0, 256, 6000, dtype=np.uint8).tobytes()
    offsets = np.array([o for o, _ in ranges])
    sizes = np.array([s for _, s in ranges])
    reads = []

    def read(offset, size):
        reads.append((offset, size))
        return blob[offset : offset + size]

    got = read_coalesced(read, offsets, sizes, gap)
    assert [bytes(g) for g in got] == [blob[o : o + s] for o, s in ranges]
    runs = coalesce(offsets, sizes, gap, max_bytes=cap)
    assert sorted(k for _, _, m in runs for k in m.tolist()) == list(range(len(ranges)))  # each once
    for start, end, members in runs:
        lo, hi = offsets[members], offsets[members] + sizes[members]
        assert start == lo.min() and end == hi.max()  # a run is just its members' span
        assert end - start <= cap or len(members) == 1
    if gap is None:
        assert len(runs) == len(ranges)
    else:
        # Consecutive runs (in offset order) are apart by more than the gap, or the cap split them.
        for (s0, e0, m0), (s1, e1, _) in zip(runs, runs[1:]):
            assert s1 - e0 > gap or max(e0, e1) - s0 > cap
    assert len(reads) == len(coalesce(offsets, sizes, gap))


def test_tar_like_neighbours_join_and_far_ones_do_not():
    # Members of 1,000 bytes, each after a 512-byte header: within the default gap, one read.
    offsets = np.arange(10) * 1512 + 512
    assert len(coalesce(offsets, np.full(10, 1000), DEFAULT_GAP)) == 1
    assert len(coalesce(offsets, np.full(10, 1000), 0)) == 10  # never back to back
    assert len(coalesce(np.array([0, 10 << 20]), np.array([10, 10]), DEFAULT_GAP)) == 2


def test_the_gap_comes_from_the_environment():
    assert gap_from_env({}) == DEFAULT_GAP
    assert gap_from_env({GAP_ENV: "4096"}) == 4096
    assert gap_from_env({GAP_ENV: "-1"}) is None
    with pytest.raises(ValueError, match=GAP_ENV):
        gap_from_env({GAP_ENV: "lots"})
