"""Compute-balanced steps (issue 33): the cost model, the balanced deal, and the plans it makes of
real long documents (every stdlib .py file and /usr/share/doc text as byte ids, untruncated)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.realtext import doc_lengths, stdlib_lengths
from helpers.skips import require
from shardtool.plan import ArraySource, Batching, DataLayout, Layout
from shardtool.plan.balance import MAX_DROP
from shardtool.plan.cost import CostModel, step_balance
from shardtool.plan.costorder import balanced_order
from shardtool.plan.group import plan_group
from shardtool.plan.packing import Packing
from shardtool.plan.shape import plan_shape
from shardtool.plan.simulate import simulate_epoch

LLAMA_7B = CostModel.parse("llama-7b")


def _source(lengths: np.ndarray, per: int = 2000) -> ArraySource:
    return ArraySource(lengths, [per] * (lengths.size // per) + ([lengths.size % per] if lengths.size % per else []))


@pytest.fixture(scope="module")
def lengths() -> np.ndarray:
    both = np.concatenate([stdlib_lengths(), doc_lengths()])
    both = both[both > 0]
    require(both.size > 3000 and int(both.max()) > 131072, "too few long stdlib or /usr/share/doc files here")
    return both


@pytest.fixture(scope="module")
def long_docs(lengths) -> ArraySource:
    return _source(lengths)


# ------------------------------------------------------------------------------ the cost model
def test_a_cost_model_comes_from_a_model_shape_a_preset_or_measured_coefficients():
    shape = CostModel.parse("params=7e9,layers=32,hidden=4096")
    assert shape == CostModel(6 * 7e9, 6 * 32 * 4096) == LLAMA_7B
    assert CostModel.parse({"params": 7e9, "layers": 32, "hidden": 4096}) == shape
    assert CostModel.parse("a=2.5, b=1e-3") == CostModel.parse({"a": 2.5, "b": 0.001}) == CostModel(2.5, 0.001)
    with pytest.raises(ValueError, match="presets"):
        CostModel.parse("gpt-17")
    with pytest.raises(ValueError, match="params, layers and hidden"):
        CostModel.parse("a=1")
    with pytest.raises(ValueError, match=">= 0"):
        CostModel(-1.0, 0.0)
    # A dict reads as the command line does: keys in any case, numbers as given, never truncated.
    assert CostModel.parse({"A": 2.5, "B": "1e-3"}) == CostModel(2.5, 0.001)
    for spec, words in [
        ({"params": 7e9, "layers": 32.5, "hidden": 4096}, "layers must be a whole number, found 32.5"),
        ("params=7e9,layers=32,hidden=4096.7", "hidden must be a whole number, found '4096.7'"),
        ({"a": True, "b": 1.0}, "a must be a number, found True"),
    ]:
        with pytest.raises(ValueError, match=words):
            CostModel.parse(spec)


def test_step_balance_is_the_slowest_rank_against_the_mean():
    bal = step_balance(np.array([[1.0, 2.0], [3.0, 2.0]]))  # step 0: 3 against a mean of 2; step 1: even
    assert bal["max_over_mean_median"] == pytest.approx(1.25) and bal["max_over_mean_max"] == pytest.approx(1.5)
    assert bal["time_lost"] == pytest.approx(1 - 4 / 5)  # a step lasts as long as its slowest rank
    # Rank 1's batches cost 5 in all, rank 0's 3: no order of them loses less than 1 - 4/5.
    assert bal["time_lost_floor"] == pytest.approx(1 - 4 / 5)
    crossed = step_balance(np.array([[1.0, 3.0], [3.0, 1.0]]))  # equal totals, badly ordered
    assert crossed["time_lost"] == pytest.approx(1 / 3) and crossed["time_lost_floor"] == 0
    assert step_balance(np.zeros((4, 0))) is None


# ------------------------------------------------------------------------------ the deal
@settings(max_examples=80, deadline=None)
@given(
    k=st.integers(1, 5),
    n=st.integers(1, 12),
    per=st.integers(1, 3),
    window=st.one_of(st.none(), st.integers(1, 12)),
    seed=st.integers(0, 3),
    micro=st.integers(1, 4),
    data=st.data(),
)
def test_each_step_takes_units_of_like_cost_and_every_group_serves_its_steps_in_one_order(
    k, n, per, window, seed, micro, data
):
    units = data.draw(st.integers(k * n, k * n * per))  # fewer than k x n x per: a group short of rows
    costs = [np.array(data.draw(st.lists(st.integers(0, 50), min_size=units, max_size=units)), float) for _ in "ab"]
    m = min(micro, n)  # a step: m consecutive batches of every rank (gradient accumulation)
    steps = -(-n // m)
    w = steps if window is None else min(window, steps)
    firsts = []
    for cost in costs:
        order, counts = balanced_order(cost, k, n, per, seed, 1, window, micro)
        assert sorted(order.tolist()) == list(range(units)), "every unit dealt once"
        assert counts.sum() == units and counts.min() >= 1 and counts.max() <= per, "no batch empty or over"
        batch = np.repeat(np.arange(k * n), counts)  # dealt batch of each position
        step = np.empty(units, np.int64)
        step[order] = (batch % n) // m
        # Within a block the steps hold runs of consecutive cost ranks: sorted by cost, the units'
        # steps change only at chunk boundaries (each step's units are neighbours in cost).
        first = []
        at = 0
        for s0 in range(0, steps, w):
            s1 = min(s0 + w, steps)
            size = int(counts.reshape(k, n)[:, s0 * m : s1 * m].sum())
            block = np.arange(at, at + size)
            at += size
            ranked = block[np.argsort(-cost[block], kind="stable")]
            seq = step[ranked]
            assert len(set(seq.tolist())) == s1 - s0 and (np.diff(np.flatnonzero(np.diff(seq)) + 1) >= k).all()
            assert sorted(set(seq.tolist())) == list(range(s0, s1))
            first.append(seq[np.concatenate([[0], np.flatnonzero(np.diff(seq)) + 1])].tolist())
        firsts.append(first)
    # The c-th costliest step of a block is served at the same step whatever the costs: groups agree.
    assert firsts[0] == firsts[1]


# ------------------------------------------------------------------------------ real long documents
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "seq, rows, nodes, per_node, target",
    [(32768, 1, 1, 8, 0.02), (8192, 4, 1, 8, 0.005), (131072, 1, 1, 8, 0.03)],
    ids=["32k-8ranks", "8k-4rows-8ranks", "128k-8ranks"],
)
def test_balanced_steps_of_real_long_documents_lose_little_time_to_the_slowest_rank(
    long_docs, seq, rows, nodes, per_node, target
):
    layout = DataLayout.pure_dp(Layout(nodes, per_node))
    plain = Batching(batch_size=rows, packing=Packing(seq, "best-fit"), seed=3)
    balanced = plain.with_balance(LLAMA_7B)
    before = simulate_epoch(long_docs, layout, plain, cost_model=LLAMA_7B)
    after = simulate_epoch(long_docs, layout, balanced, cost_model=LLAMA_7B)
    lost = (before.balance()["time_lost"], after.balance()["time_lost"])
    assert lost[1] <= target < lost[0], lost
    assert after.balance()["max_over_mean_median"] <= 1.02
    assert after.shape.batches_per_rank == before.shape.batches_per_rank  # equal counts, the same count
    assert after.fill_rate == before.fill_rate and after.remainder_tokens == before.remainder_tokens
    shape = plan_shape(long_docs.summaries, layout, balanced, long_docs.lengths_range)
    plain_shape = plan_shape(long_docs.summaries, layout, plain, long_docs.lengths_range)
    for g in range(layout.num_groups):  # the same rows, dealt otherwise: every piece served once
        a, b = (plan_group(long_docs, s, g, 0).rows for s in (plain_shape, shape))
        assert sorted(zip(a.span_pos.tolist(), a.span_len.tolist())) == sorted(
            zip(b.span_pos.tolist(), b.span_len.tolist())
        )


@pytest.mark.timeout(300)
def test_balance_across_nodes_aligns_each_groups_steps_by_cost_rank(long_docs):
    """No group sees another's rows: steps align by cost rank only. The median step is near even
    (a third of its excess or less: how near depends on the machine's /usr/share/doc, 1.0128 here
    with 4,062 files of it); the costliest steps are not where the groups' shares differ (some hold
    more long documents)."""
    layout = DataLayout.pure_dp(Layout(8, 8))  # 64 DP ranks in 8 data groups
    plain = Batching(batch_size=1, packing=Packing(32768, "best-fit"), seed=3)
    before = simulate_epoch(long_docs, layout, plain, cost_model=LLAMA_7B).balance()
    after = simulate_epoch(long_docs, layout, plain.with_balance(LLAMA_7B), cost_model=LLAMA_7B).balance()
    assert after["max_over_mean_median"] - 1 <= (before["max_over_mean_median"] - 1) / 3, (before, after)
    assert after["time_lost"] < before["time_lost"], (before, after)
    # What is left is the shares, not the order: within a point of the least any order of the
    # same batches can lose (4.28% against 4.11% here: the nodes' totals differ by about 4%).
    assert after["time_lost"] <= after["time_lost_floor"] + 0.01, (before, after)


@pytest.mark.timeout(120)
def test_a_report_over_forked_processes_is_the_report_of_one(long_docs):
    """`shardtool plan --processes 2` forks its groups' plans: the same groups, batches and
    costs, in the groups' order."""
    layout = DataLayout.pure_dp(Layout(4, 2))
    balanced = Batching(batch_size=1, packing=Packing(32768, "best-fit"), seed=3).with_balance(LLAMA_7B)
    one = simulate_epoch(long_docs, layout, balanced, cost_model=LLAMA_7B)
    two = simulate_epoch(long_docs, layout, balanced, cost_model=LLAMA_7B, processes=2)
    assert [s.group for s in two.groups] == list(range(4))
    for a, b in zip(one.groups, two.groups):
        assert a.samples_per_rank == b.samples_per_rank and np.array_equal(a.costs, b.costs)
    assert one.balance() == two.balance()


@pytest.mark.timeout(120)
def test_long_documents_split_and_stored_shuffled_bring_64_ranks_within_the_target(long_docs, lengths):
    """What stands between 64 ranks of this machine's corpus and the 32k target is storage: a
    node's contiguous range holds the whole of a few documents of millions of tokens. The same
    documents cut into documents of at most 262,144 tokens (longer than any row, so no row's
    context changes) and stored in a random order lose 1.0-1.15% over six orders here (1.4-2.0%
    with half the documents), against 4.7% as stored; cutting alone or shuffling alone does not
    get there (4.6%, 3.6%)."""
    from shardtool.benchmarks.compute_balance import split_and_shuffled

    layout = DataLayout.pure_dp(Layout(8, 8))
    balanced = Batching(batch_size=1, packing=Packing(32768, "best-fit"), seed=3).with_balance(LLAMA_7B)
    stored = simulate_epoch(long_docs, layout, balanced, cost_model=LLAMA_7B).balance()
    prepared = split_and_shuffled(lengths, 262144)
    assert sorted(prepared.tolist()) != sorted(lengths.tolist()) and prepared.sum() == lengths.sum()
    assert prepared.max() == 262144
    split = simulate_epoch(_source(prepared), layout, balanced, cost_model=LLAMA_7B).balance()
    assert split["time_lost"] <= 0.02 < stored["time_lost_floor"], (stored, split)


@pytest.mark.timeout(300)
def test_across_nodes_the_loss_left_falls_as_each_nodes_share_grows(lengths):
    """Issue 33's 64-rank target (32,768 x 1 row: at most 2% of step time lost) on a corpus of the
    real documents' shape, large enough that each node's share holds ~1,100 rows a rank: this
    machine's documents drawn at random (a fixed seed) until they make 2.4B tokens. With the real
    corpus alone a node's share is ~70 steps and the nodes' totals differ by several percent (the
    floor above); as shares grow they converge, and the balanced order reaches the target (0.2% to
    0.7% over six seeds here, and with half the documents; at 600M tokens, 0.6% to 2.8%: a few
    documents of millions of tokens still tip one node's total)."""
    rng = np.random.default_rng(5)
    draws = rng.choice(lengths, size=int(2.4e9 / lengths.mean()) + 1)
    layout = DataLayout.pure_dp(Layout(8, 8))
    plain = Batching(batch_size=1, packing=Packing(32768, "best-fit"), seed=3)
    before = simulate_epoch(_source(draws), layout, plain, cost_model=LLAMA_7B).balance()
    after = simulate_epoch(_source(draws), layout, plain.with_balance(LLAMA_7B), cost_model=LLAMA_7B).balance()
    assert after["time_lost"] <= 0.02 < before["time_lost"], (before, after)
    assert after["max_over_mean_median"] <= 1.02, (before, after)


def test_a_bucketed_token_budget_is_balanced_by_its_padded_cost(lengths):
    source = _source(lengths[lengths <= 65536])  # unpacked: a batch holds whole documents
    layout = DataLayout.pure_dp(Layout(1, 8))
    plain = Batching(max_tokens=65536, seed=1)
    before = simulate_epoch(source, layout, plain, cost_model=LLAMA_7B).balance()
    after = simulate_epoch(source, layout, plain.with_balance(LLAMA_7B), cost_model=LLAMA_7B).balance()
    assert after["time_lost"] < before["time_lost"] / 2, (before, after)


def test_without_a_cost_model_the_fingerprint_is_todays():
    plain = Batching(batch_size=4, packing=Packing(1024, "best-fit"))
    assert plain.with_balance(None).fingerprint() == plain.fingerprint()
    assert plain.with_balance(LLAMA_7B).fingerprint() != plain.fingerprint()
    assert plain.with_balance(LLAMA_7B, 16).fingerprint() != plain.with_balance(LLAMA_7B).fingerprint()
    with pytest.raises(ValueError, match="cost model"):
        Batching(batch_size=4, balance_window=8)


def test_a_cost_model_is_calibrated_from_timed_steps():
    from shardtool.plan.cost import fit_cost_model

    rng = np.random.default_rng(0)
    tokens = rng.integers(1000, 9000, 40).astype(float)
    squares = rng.integers(10**5, 10**8, 40).astype(float)
    seconds = 3e-5 * tokens + 2e-9 * squares
    model, corr = fit_cost_model(tokens, squares, seconds * (1 + 0.01 * rng.standard_normal(40)))
    assert model.a == pytest.approx(3e-5, rel=0.05) and model.b == pytest.approx(2e-9, rel=0.05) and corr > 0.99
    # Times that fall with the squares: no negative coefficient, the tokens alone explain them.
    model, _ = fit_cost_model(tokens, squares, np.maximum(3e-5 * tokens - 1e-13 * squares, 1e-6))
    assert model.b == 0 and model.a > 0
    with pytest.raises(ValueError, match="at least two"):
        fit_cost_model([1.0], [1.0], [1.0])
    # Rows of one length (tokens alike) whose times do not follow their squares on a busy machine:
    # the fit predicts one cost for all, which explains nothing. Its correlation is 0, where the
    # float noise of a constant prediction read as a number (4e-16 in a user's trial).
    rng = np.random.default_rng(0)
    squares = rng.integers(10**5, 10**8, 47).astype(float)  # 47 batches: a constant's std is not 0.0
    model, corr = fit_cost_model(np.full(47, 2048.0), squares, 0.1 - 1e-11 * squares + 1e-3 * rng.standard_normal(47))
    assert model.b == 0 and corr == 0.0


@pytest.mark.timeout(120)
def test_the_benchmark_times_a_document_masked_transformer_against_the_cost_model():
    from shardtool.benchmarks.compute_balance import measure

    got = measure(seq=256, count=4, dim=32)
    assert got["rows"] >= 2 and 0 < got["seconds_min_max"][0] <= got["seconds_min_max"][1]
    assert got["fitted"]["a"] >= 0 and got["fitted"]["b"] >= 0 and -1 <= got["shape_correlation"] <= 1


@pytest.mark.timeout(300)
def test_with_gradient_accumulation_each_ranks_step_total_is_balanced(long_docs):
    """micro_batches=4 at 8,192 x 1 row on 8 ranks: a step is 4 batches of each rank, and it is
    their sum that is evened (each micro-batch alone need not be)."""
    layout = DataLayout.pure_dp(Layout(1, 8))
    plain = Batching(batch_size=1, packing=Packing(8192, "best-fit"), seed=2)
    before = simulate_epoch(long_docs, layout, plain, cost_model=LLAMA_7B).balance(micro=4)
    balanced = plain.with_balance(LLAMA_7B, micro=4)
    after = simulate_epoch(long_docs, layout, balanced, cost_model=LLAMA_7B).balance()
    assert after["steps"] == before["steps"] and after["time_lost"] <= 0.005 < before["time_lost"], (before, after)
    with pytest.raises(ValueError, match="micro_batches is a setting of compute balancing"):
        Batching(batch_size=1, micro_batches=4)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seq, rows, target", [(32768, 1, 0.02), (8192, 4, 0.005), (131072, 1, 0.03)])
def test_nodes_reading_one_range_together_balance_64_ranks_of_the_corpus_as_stored(long_docs, seq, rows, target):
    """Where a node's own range holds documents of millions of tokens whole, the floor is between
    nodes and no order lowers it. Eight nodes that read one range together (`nodes_per_group=8`,
    each caching all of it) deal the range's rows across all 64 ranks, as one node deals its own
    across 8: every target is met on the corpus as stored (0.09%, 0.28%, 2.47% here), where groups
    of one node stay at their floor (0.86%, 4.7%, 18%)."""
    from shardtool.plan import shards_for_node

    nodes = Layout(8, 8)
    balanced = Batching(batch_size=rows, packing=Packing(seq, "best-fit"), seed=3).with_balance(LLAMA_7B)
    apart = simulate_epoch(long_docs, DataLayout.pure_dp(nodes), balanced, cost_model=LLAMA_7B)
    together = simulate_epoch(long_docs, DataLayout.pure_dp(nodes, 8), balanced, cost_model=LLAMA_7B)
    lost = (apart.balance()["time_lost"], together.balance()["time_lost"])
    assert lost[1] <= target < lost[0], lost
    # One deal of the same rows: as full (0.992 against 0.977 here: one range has fewer cuts), and
    # what equal counts leave over within the plan's allowance. (Not "no more than apart": each
    # count is the smallest whose drop is within it, so either side may drop a little more; on
    # 2026-12-07's machine together left 90k tokens, apart 25k, of 144M.)
    assert together.fill_rate >= apart.fill_rate
    assert together.remainder_tokens <= MAX_DROP * together.total_tokens
    # What it costs: every node of the group caches the group's range, here the whole dataset.
    every = list(range(len(long_docs.summaries.samples)))
    assert all(shards_for_node(long_docs.summaries, DataLayout.pure_dp(nodes, 8), n) == every for n in range(8))
    assert len(shards_for_node(long_docs.summaries, DataLayout.pure_dp(nodes), 0)) < len(every)
