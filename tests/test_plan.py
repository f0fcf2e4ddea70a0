"""Properties of node ranges, epoch plans and layout detection."""

from __future__ import annotations


import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardtool.plan import (
    Batching,
    node_ranges,
    node_shard_ranges,
    plan_epoch,
    sample_locations,
    shards_for_node,
)
from shardtool.plan import Layout, rank_placement
from shardtool.plan.synthetic import lognormal_lengths
from strategies import Dataset, cases, datasets, make_lengths

settings.register_profile("plan", max_examples=60, deadline=None)
settings.load_profile("plan")


def all_batches(plan):
    return [b for r in range(plan.layout.world_size) for b in plan.rank_batches(r)]


def served(plan) -> np.ndarray:
    return plan.sample_ids


# --- node ranges -------------------------------------------------------------------------


@given(datasets(), st.integers(1, 8))
def test_node_ranges_partition_contiguous_and_token_balanced(data: Dataset, num_nodes: int):
    cuts = node_ranges(data.lengths, num_nodes)
    assert cuts.shape == (num_nodes + 1,)
    assert cuts[0] == 0 and cuts[-1] == data.lengths.size
    assert np.all(np.diff(cuts) >= 0)
    weights = np.maximum(data.lengths, 1)
    per_node = np.add.reduceat(np.append(weights, 0), cuts[:-1]) * (np.diff(cuts) > 0)
    assert np.all(np.abs(per_node - weights.sum() / num_nodes) <= weights.max())


def test_node_ranges_with_fewer_samples_than_nodes():
    cuts = node_ranges(np.array([5, 0, 7]), 8)
    assert cuts[0] == 0 and cuts[-1] == 3 and np.all(np.diff(cuts) >= 0)
    assert (np.diff(cuts) == 0).sum() == 5
    assert node_ranges(np.zeros(0, np.int64), 3).tolist() == [0, 0, 0, 0]


@given(datasets(), st.integers(1, 8))
def test_shards_for_node_cover_every_shard_and_stay_contiguous(data: Dataset, num_nodes: int):
    cuts = node_ranges(data.lengths, num_nodes)
    pieces = node_shard_ranges(data.lengths, data.shard_counts, num_nodes)
    readers: dict[int, list[int]] = {}
    for node in range(num_nodes):
        shards = shards_for_node(data.lengths, data.shard_counts, node, num_nodes)
        assert shards == sorted(shards) == [s for s, _, _ in pieces[node]]
        for shard in shards:
            readers.setdefault(shard, []).append(node)
        # The pieces are exactly the node's sample range, in order.
        offsets = np.concatenate([[0], np.cumsum(data.shard_counts)])
        ids = [np.arange(offsets[s] + a, offsets[s] + b) for s, a, b in pieces[node]]
        got = np.concatenate(ids) if ids else np.zeros(0, np.int64)
        assert np.array_equal(got, np.arange(cuts[node], cuts[node + 1]))
    assert sorted(readers) == np.flatnonzero(data.shard_counts).tolist()
    owning = np.flatnonzero(np.diff(cuts) > 0).tolist()
    for nodes in readers.values():
        # A shard is shared only by neighbouring nodes (skipping nodes that own nothing).
        assert nodes == [k for k in owning if nodes[0] <= k <= nodes[-1]]


def test_few_shards_per_node_are_split_between_neighbours():
    lengths = make_lengths(np.random.default_rng(3), 14 * 500, "lognormal")
    counts = np.full(14, 500)
    pieces = node_shard_ranges(lengths, counts, 4)
    tokens = [sum(int(lengths[s * 500 + a : s * 500 + b].sum()) for s, a, b in p) for p in pieces]
    assert max(tokens) - min(tokens) <= 2 * lengths.max()
    assert sum(len(p) for p in pieces) > 14  # some boundary shard is read by two nodes


def test_sample_locations_roundtrip():
    shard, index = sample_locations([3, 0, 2], [0, 2, 3, 4])
    assert shard.tolist() == [0, 0, 2, 2] and index.tolist() == [0, 2, 0, 1]
    with pytest.raises(ValueError, match=r"\[0, 5\)"):
        sample_locations([3, 0, 2], [5])


# --- plan invariants --------------------------------------------------------------------


@given(cases())
def test_plan_invariants(case):
    lengths, layout, batching = case.data.lengths, case.layout, case.batching
    plan = plan_epoch(lengths, case.data.shard_counts, layout, batching, case.epoch)
    n = plan.batches_per_rank
    assert n >= 1
    cuts = node_ranges(lengths, layout.num_nodes)
    for rank in range(layout.world_size):
        batches = plan.rank_batches(rank)
        assert len(batches) == n
        node = layout.node_of(rank)
        for batch in batches:
            assert batch.size >= 1
            # Node stickiness: a rank only reads its node's range.
            assert cuts[node] <= batch.min() and batch.max() < cuts[node + 1]
            blen = lengths[batch]
            assert np.all(np.diff(blen) <= 0), "bucketed batches are longest first"
            if batching.batch_size is not None:
                assert batch.size <= batching.batch_size
            else:
                assert batch.size * max(int(blen.max()), 1) <= batching.max_tokens
    ids = served(plan)
    assert np.unique(ids).size == ids.size, "no sample twice in an epoch"
    assert np.intersect1d(ids, plan.remainder).size == 0
    assert np.array_equal(np.sort(np.concatenate([ids, plan.remainder])), np.arange(lengths.size))
    assert 0.0 < plan.padding_efficiency <= 1.0
    again = plan_epoch(lengths, case.data.shard_counts, layout, batching, case.epoch)
    assert np.array_equal(again.sample_ids, plan.sample_ids)
    assert np.array_equal(again.batch_offsets, plan.batch_offsets)


@given(cases(mode="max_tokens", any_window=False))
def test_max_tokens_remainder_is_less_than_one_batch_per_rank(case):
    # With a tiny window there is no bucketing and a node of many short samples
    # can out-number, batch for batch, what its neighbour can split into; the
    # bound is a property of bucketed plans.
    plan = plan_epoch(case.data.lengths, case.data.shard_counts, case.layout, case.batching, case.epoch)
    assert case.data.lengths[plan.remainder].sum() < case.layout.world_size * case.batching.max_tokens


@pytest.mark.parametrize("budget", [4096, 16384, 65536])
def test_max_tokens_few_shards_per_node_drops_less_than_a_batch_per_rank(budget):
    lengths = lognormal_lengths(14 * 700, seed=7, sigma=1.0, high=4096)
    counts = np.full(14, 700)
    layout = Layout(4, 2)
    for epoch in range(3):
        plan = plan_epoch(lengths, counts, layout, Batching(max_tokens=budget), epoch)
        assert lengths[plan.remainder].sum() < layout.world_size * budget


@given(cases(mode="batch_size"))
def test_batch_size_mode_only_deficit_nodes_have_short_batches(case):
    layout, size = case.layout, case.batching.batch_size
    plan = plan_epoch(case.data.lengths, case.data.shard_counts, layout, case.batching, case.epoch)
    per_node = np.diff(node_ranges(case.data.lengths, layout.num_nodes))
    g, n = layout.ranks_per_node, plan.batches_per_rank
    for node in range(layout.num_nodes):
        batches = [b for r in range(node * g, (node + 1) * g) for b in plan.rank_batches(r)]
        short = sum(b.size < size for b in batches)
        if -(-per_node[node] // size) >= g * n:
            # Windows are multiples of batch_size: only the node's last batch can be short.
            assert short <= 1


@given(cases(), st.integers(0, 1000))
def test_epochs_differ_when_shuffled_and_repeat_when_not(case, other):
    if other == case.epoch:
        other += 1
    args = (case.data.lengths, case.data.shard_counts, case.layout)
    a = plan_epoch(*args, case.batching, case.epoch)
    b = plan_epoch(*args, case.batching, other)
    if case.batching.shuffle:
        if case.data.lengths.size >= 1000:
            assert not np.array_equal(a.sample_ids, b.sample_ids)
    else:
        # No randomness: one fixed set of batches, of which only the dropped ones
        # change with the epoch; so two batches of the two epochs are equal or disjoint.
        batch_of = {}
        for batch in all_batches(a):
            for i in batch.tolist():
                batch_of[i] = tuple(batch.tolist())
        for batch in all_batches(b):
            owners = {batch_of.get(i) for i in batch.tolist()}
            assert owners == {None} or owners == {tuple(batch.tolist())}


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("layout", [Layout(1, 1), Layout(4, 2), Layout(3, 1)])
def test_remainder_rotates_so_every_sample_is_served(shuffle, layout):
    lengths = make_lengths(np.random.default_rng(11), 3000, "lognormal")
    counts = np.full(30, 100)
    batching = Batching(max_tokens=int(lengths.max()) * 2, shuffle=shuffle)
    seen = np.zeros(lengths.size, dtype=bool)
    for epoch in range(12):
        seen[plan_epoch(lengths, counts, layout, batching, epoch).sample_ids] = True
    assert seen.all()


def test_subset_plans_only_the_subset():
    lengths = make_lengths(np.random.default_rng(5), 2000, "zeros")
    counts = np.full(20, 100)
    mask = np.random.default_rng(6).random(2000) < 0.5
    layout, batching = Layout(2, 2), Batching(batch_size=4)
    by_mask = plan_epoch(lengths, counts, layout, batching, 3, subset=mask)
    by_ids = plan_epoch(lengths, counts, layout, batching, 3, subset=np.flatnonzero(mask))
    assert np.array_equal(by_mask.sample_ids, by_ids.sample_ids)
    assert np.array_equal(np.sort(np.concatenate([by_mask.sample_ids, by_mask.remainder])), np.flatnonzero(mask))
    full = plan_epoch(lengths, counts, layout, batching, 3)
    all_true = plan_epoch(lengths, counts, layout, batching, 3, subset=np.ones(2000, bool))
    assert np.array_equal(full.sample_ids, all_true.sample_ids)


# --- padding efficiency and speed -------------------------------------------------------


def text_lengths(size: int, seed: int = 0) -> np.ndarray:
    return lognormal_lengths(size, seed=seed, sigma=1.0)


def test_bucketing_padding_efficiency_beats_random_batching():
    lengths = text_lengths(50_000)
    counts = np.full(50, 1000)
    plan = plan_epoch(lengths, counts, Layout(1, 1), Batching(max_tokens=65536), 0)
    assert plan.padding_efficiency >= 0.95
    # Random batching with the same batch sizes: what an unbucketed loader pads to.
    shuffled = lengths[np.random.default_rng(1).permutation(lengths.size)]
    sizes = np.diff(plan.batch_offsets)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    longest = np.maximum.reduceat(shuffled[: sizes.sum()], starts)
    random_efficiency = shuffled[: sizes.sum()].sum() / (longest * sizes).sum()
    print(f"padding efficiency: bucketed {plan.padding_efficiency:.3f}, random {random_efficiency:.3f}")
    assert random_efficiency < 0.5 < 0.95 <= plan.padding_efficiency


# --- errors and config ------------------------------------------------------------------


def test_oversized_sample_is_refused_with_its_id_and_the_budget():
    lengths = np.array([10, 20, 5000, 30])
    with pytest.raises(ValueError, match=r"sample 2 has length 5000, more than max_tokens=4096"):
        plan_epoch(lengths, [4], Layout(1, 1), Batching(max_tokens=4096), 0)


def test_too_small_dataset_is_refused_with_numbers():
    with pytest.raises(ValueError, match=r"too small.*3 samples.*8 ranks"):
        plan_epoch(np.array([1, 2, 3]), [3], Layout(4, 2), Batching(batch_size=2), 0)


def test_batching_validation_and_fingerprint():
    with pytest.raises(ValueError, match="exactly one"):
        Batching()
    with pytest.raises(ValueError, match="exactly one"):
        Batching(batch_size=2, max_tokens=10)
    with pytest.raises(ValueError, match="batch_size"):
        Batching(batch_size=0)
    with pytest.raises(ValueError, match="seed"):
        Batching(batch_size=2, seed=-1)
    a = Batching(max_tokens=4096, seed=1)
    assert a.fingerprint() == Batching(max_tokens=4096, seed=1).fingerprint()
    assert len(a.fingerprint()) == 16 and int(a.fingerprint(), 16) >= 0
    assert a.fingerprint() != Batching(max_tokens=4096, seed=2).fingerprint()
    assert a.fingerprint() != Batching(max_tokens=4096, seed=1, shuffle=False).fingerprint()


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="expected 3"):
        plan_epoch(np.array([1, 2, 3]), [2], Layout(1, 1), Batching(batch_size=1), 0)
    with pytest.raises(ValueError, match=">= 0"):
        plan_epoch(np.array([1, -2, 3]), [3], Layout(1, 1), Batching(batch_size=1), 0)
    with pytest.raises(ValueError, match="epoch"):
        plan_epoch(np.array([1, 2, 3]), [3], Layout(1, 1), Batching(batch_size=1), -1)
    with pytest.raises(ValueError, match="sorted"):
        plan_epoch(np.array([1, 2, 3]), [3], Layout(1, 1), Batching(batch_size=1), 0, subset=[2, 1])


# --- layout -----------------------------------------------------------------------------


class FakeDist:
    def __init__(self, rank, world, initialized=True):
        self.rank, self.world, self.initialized = rank, world, initialized

    def is_available(self):
        return True

    def is_initialized(self):
        return self.initialized

    def get_rank(self):
        return self.rank

    def get_world_size(self):
        return self.world


TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}
SLURM = {"SLURM_PROCID": "3", "SLURM_NTASKS": "6", "SLURM_NTASKS_PER_NODE": "2(x3)"}


def test_layout_basics():
    layout = Layout(3, 4)
    assert layout.world_size == 12 and layout.node_of(5) == 1 and layout.local_rank(5) == 1
    with pytest.raises(ValueError, match="rank"):
        layout.node_of(12)
    with pytest.raises(ValueError, match="num_nodes"):
        Layout(0, 1)
    with pytest.raises(ValueError, match="ranks_per_node"):
        Layout(1, True)


@pytest.mark.parametrize(
    "args, env, dist, expected",
    [
        ({}, {}, None, (0, Layout(1, 1))),
        ({}, SLURM, None, (3, Layout(3, 2))),
        ({}, {**SLURM, **TORCHRUN}, None, (5, Layout(2, 4))),
        ({}, {**SLURM, **TORCHRUN}, FakeDist(1, 16), (1, Layout(4, 4))),
        ({}, TORCHRUN, FakeDist(1, 16, initialized=False), (5, Layout(2, 4))),
        ({"rank": 2, "world_size": 4, "ranks_per_node": 2}, TORCHRUN, FakeDist(1, 16), (2, Layout(2, 2))),
        ({"rank": 1}, TORCHRUN, None, (1, Layout(2, 4))),
        ({}, {"RANK": "2", "WORLD_SIZE": "3"}, None, (2, Layout(1, 3))),
        ({}, {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2,2"}, None, (1, Layout(2, 2))),
    ],
)
def test_rank_placement_precedence(args, env, dist, expected):
    placement = rank_placement(**args, env=env, dist=dist)
    assert (placement.rank, placement.layout) == expected


@pytest.mark.parametrize(
    "args, env, message",
    [
        ({}, {"RANK": "8", "WORLD_SIZE": "8"}, r"rank must be in \[0, 8\), found 8"),
        ({}, {"RANK": "0", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4"}, "found world_size=6, ranks_per_node=4"),
        ({}, {"RANK": "x", "WORLD_SIZE": "6"}, "RANK must be an integer, found 'x'"),
        ({}, {"SLURM_PROCID": "0", "SLURM_NTASKS": "3", "SLURM_NTASKS_PER_NODE": "2(x1),1"}, "uneven"),
        ({"world_size": 0}, {}, "world_size must be >= 1"),
    ],
)
def test_rank_placement_refuses_inconsistent_input(args, env, message):
    with pytest.raises(ValueError, match=message):
        rank_placement(**args, env=env)


def test_1m_samples_on_512_ranks_drop_less_than_a_batch_per_rank():
    # Planning time is a benchmark number (`shardtool plan`, benchmarks/plan_scale.py), not a test.
    lengths = text_lengths(1_000_000, seed=2)
    counts = np.full(1000, 1000)
    plan = plan_epoch(lengths, counts, Layout(64, 8), Batching(max_tokens=65536), 0)
    assert lengths[plan.remainder].sum() < 512 * 65536


def test_fewer_batches_than_ranks_are_split_so_every_rank_gets_one():
    # Found by hypothesis: 400 short samples bucket into 7 token-budget batches for 8 ranks.
    # Splitting batches costs nothing, so each rank must still get a batch, and nothing dropped.
    lengths = np.full(400, 50, dtype=np.int64)
    plan = plan_epoch(lengths, np.array([400]), Layout(1, 8), Batching(max_tokens=3000, shuffle=False), 0)
    assert plan.batches_per_rank == 1
    served = np.concatenate([plan.rank_batches(r)[0] for r in range(8)])
    assert len(np.unique(served)) == 400 and plan.remainder.size == 0
