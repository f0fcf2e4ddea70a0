"""Exact plans (`Batching.exact`): on any layout, every sample (packed: every token) served once
in total, equal batch counts, padding only where a group cannot split down to the count, and the
same after an elastic resume onto another number of ranks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.strategies import LAYOUTS, datasets
from shardtool.plan import ArraySource, Batching, DataLayout, Layout, Planner
from shardtool.plan.packing import Packing

DATASET = "manifest-sha-exact"


@st.composite
def exact_batchings(draw, lengths: np.ndarray) -> Batching:
    mode = draw(st.sampled_from(["batch_size", "max_tokens", "packed"]))
    shuffle, seed = draw(st.booleans()), draw(st.integers(0, 3))
    if mode == "batch_size":
        return Batching(batch_size=draw(st.integers(1, 9)), shuffle=shuffle, seed=seed, exact=True)
    if mode == "max_tokens":
        low = max(int(lengths.max(initial=1)), 1)
        return Batching(max_tokens=draw(st.integers(low, 4 * low)), shuffle=shuffle, seed=seed, exact=True)
    packing = Packing(
        seq_len=draw(st.sampled_from([16, 64, 256])),
        policy=draw(st.sampled_from(["best-fit", "concat", "no-split", "stream"])),
        eos_id=draw(st.sampled_from([None, 0])),
    )
    return Batching(batch_size=draw(st.integers(1, 3)), packing=packing, shuffle=shuffle, seed=seed, exact=True)


def _plans(source, batching, state, layout):
    return [Planner(source, batching).rank_plan(state, d) for d in range(layout.dp_size)]


def _served(plan, first: int = 0, last: int | None = None):
    """(sample ids, or per document its tokens) of batches [first, last) that are not padding."""
    last = plan.batches_per_rank if last is None else last
    ids, tokens = [], {}
    for b in range(first, last):
        if plan.pad[b]:
            if plan.rows is not None:
                assert plan.batch_rows(b).num_rows == 0  # a padding batch has no row
            else:
                assert plan.batch(b).size == 1  # one stand-in sample
            continue
        if plan.rows is not None:
            rows = plan.batch_rows(b)
            assert rows.num_rows >= 1 and (rows.row_tokens() > 0).all()
            for p, n in zip(rows.span_pos.tolist(), rows.span_len.tolist()):
                tokens[p] = tokens.get(p, 0) + n
        else:
            ids += plan.batch(b).tolist()
    return ids, tokens


def _check_all_once(lengths, batching, ids, tokens):
    if batching.packing is None:
        assert sorted(ids) == list(range(lengths.size))
        return
    extra = batching.packing.extra_tokens
    want = {i: int(n) + extra for i, n in enumerate(lengths.tolist()) if n + extra > 0}
    if batching.packing.policy == "no-split":  # longer than a row: dropped at packing, not a remainder
        want = {i: n for i, n in want.items() if n <= batching.packing.seq_len}
    assert tokens == want


@settings(max_examples=120, deadline=None)
@given(data=datasets(max_size=600), layout=st.sampled_from(LAYOUTS), epoch=st.integers(0, 2), draw=st.data())
def test_every_sample_once_with_equal_counts(data, layout, epoch, draw):
    batching = draw.draw(exact_batchings(data.lengths))
    source = ArraySource(data.lengths, data.shard_counts)
    data_layout = DataLayout.pure_dp(layout)
    planner = Planner(source, batching)
    state = planner.start(epoch, DATASET, data_layout)
    plans = _plans(source, batching, state, data_layout)
    assert len({p.batches_per_rank for p in plans}) == 1
    ids, tokens = [], {}
    for plan in plans:
        if plan.remainder is not None and batching.packing is not None:  # documents with no token to serve
            assert (data.lengths[plan.remainder] + batching.packing.extra_tokens == 0).all() or (
                batching.packing.policy == "no-split"
            )
        elif plan.remainder is not None:
            assert plan.remainder.size == 0
        got_ids, got_tokens = _served(plan)
        ids += got_ids
        for p, n in got_tokens.items():
            tokens[p] = tokens.get(p, 0) + n
    _check_all_once(data.lengths, batching, ids, tokens)


@settings(max_examples=80, deadline=None)
@given(
    data=datasets(min_size=20, max_size=400),
    before=st.sampled_from(LAYOUTS),
    after=st.sampled_from(LAYOUTS),
    third=st.sampled_from(LAYOUTS),
    draw=st.data(),
)
def test_elastic_resumes_still_serve_every_sample_once(data, before, after, third, draw):
    batching = draw.draw(exact_batchings(data.lengths))
    source = ArraySource(data.lengths, data.shard_counts)
    planner = Planner(source, batching)
    state = planner.start(0, DATASET, DataLayout.pure_dp(before))
    ids, tokens = [], {}

    def serve(state, upto):
        plans = _plans(source, batching, state, state.last.layout)
        count = plans[0].batches_per_rank
        assert {p.batches_per_rank for p in plans} == {count}
        upto = min(upto, count)
        for plan in plans:
            got_ids, got_tokens = _served(plan, state.last.served, upto)
            ids.extend(got_ids)
            for p, n in got_tokens.items():
                tokens[p] = tokens.get(p, 0) + n
        return state.with_served(upto)

    state = serve(state, draw.draw(st.integers(0, 6)))
    for layout in (after, third):
        state = planner.continue_on(state, DataLayout.pure_dp(layout))
        planner.check(state)
        state = serve(state, state.last.served + draw.draw(st.integers(0, 4)))
    state = planner.continue_on(state, DataLayout.pure_dp(third))
    serve(state, 10**9)
    assert planner.left_over(state) == []
    _check_all_once(data.lengths, batching, ids, tokens)


def test_one_sample_batches_on_three_ranks_pad_two():
    # 50 samples, batch_size 1, 3 ranks: 17 batches each, two of them padding (drop_last=False
    # without exact leaves 2 samples as a reported remainder instead).
    source = ArraySource(np.full(50, 10), [50])
    layout = DataLayout.pure_dp(Layout(1, 3))
    plans = _plans(
        source,
        Batching(batch_size=1, exact=True),
        Planner(source, Batching(batch_size=1, exact=True)).start(0, DATASET, layout),
        layout,
    )
    assert [p.batches_per_rank for p in plans] == [17, 17, 17]
    assert sum(int(p.pad.sum()) for p in plans) == 1
    plain = Batching(batch_size=1, drop_last=False)
    assert (
        sum(
            Planner(source, plain).rank_plan(Planner(source, plain).start(0, DATASET, layout), d).batches_per_rank
            for d in range(3)
        )
        == 48
    )


def test_more_ranks_than_samples_pad_instead_of_refusing():
    source = ArraySource(np.array([5, 7, 9]), [3])
    layout = DataLayout.pure_dp(Layout(1, 8))
    batching = Batching(batch_size=2, exact=True)
    plans = _plans(source, batching, Planner(source, batching).start(0, DATASET, layout), layout)
    assert {p.batches_per_rank for p in plans} == {1}
    assert sorted(i for p in plans for i in _served(p)[0]) == [0, 1, 2]
    assert sum(int(p.pad.sum()) for p in plans) == 5


def test_exact_fingerprint_differs_and_plain_configs_keep_theirs():
    plain = Batching(batch_size=4, drop_last=False)
    assert Batching(batch_size=4, exact=True).fingerprint() != plain.fingerprint()
    assert "exact" not in plain.describe()
    with pytest.raises(ValueError, match="drop_last=True"):
        Batching(batch_size=4, exact=True, drop_last=True)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_split_exact_rows_of_documents_that_cannot_share_a_row(seed):
    """27 documents of 50 tokens at seq_len 64: no two share a row, so no-split needs 27 rows
    whatever the order. The shuffled exact count used the concat bound (23 from the tokens),
    which cuts documents no-split never cuts: the plan raised (found by CI's hypothesis run)."""
    lengths = np.full(27, 50, np.int64)
    source = ArraySource(lengths, np.array([27]))
    batching = Batching(batch_size=1, packing=Packing(seq_len=64, policy="no-split"), seed=seed, exact=True)
    data_layout = DataLayout.pure_dp(Layout(1, 1))
    state = Planner(source, batching).start(0, DATASET, data_layout)
    (plan,) = _plans(source, batching, state, data_layout)
    _, tokens = _served(plan)
    assert tokens == {i: 50 for i in range(27)} and plan.batches_per_rank == 27
