"""Block-wise shuffles (``shuffle_block``, issue 32 item 10): a pass reads a group's samples a block
of neighbours at a time, so a compressed share read in place is decompressed ahead of its reads.
Every sample is still served once, counts stay equal and exact, and each batch mixes one block."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.realtext import doc_lengths, stdlib_lengths
from shardtool.plan import ArraySource, Batching, DataLayout, Layout, Planner, plan_shape
from shardtool.plan.batching import block_samples

DATASET = "manifest-block"


def _plans(lengths, counts, layout: Layout, batching: Batching, epoch: int = 0):
    data = DataLayout.pure_dp(layout)
    source = ArraySource(lengths, counts)
    out = []
    for d in range(data.dp_size):
        planner = Planner(source, batching)
        out.append(planner.rank_plan(planner.start(epoch, DATASET, data), d))
    return data, out


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(50, 3000),
    block=st.integers(1, 500),
    nodes=st.integers(1, 3),
    per_node=st.integers(1, 3),
    size=st.integers(1, 9),
    budget=st.one_of(st.none(), st.integers(600, 3000)),
    seed=st.integers(0, 2**20),
    epoch=st.integers(0, 3),
)
def test_each_batch_is_one_blocks_and_a_pass_reads_block_after_block(
    n, block, nodes, per_node, size, budget, seed, epoch
):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 300, n)
    counts = np.diff(np.linspace(0, n, 6).astype(np.int64))
    kw = dict(max_tokens=budget) if budget else dict(batch_size=size)
    batching = Batching(seed=seed, shuffle_block=block, drop_last=False, **kw)
    data, plans = _plans(lengths, counts, Layout(nodes, per_node), batching, epoch)
    shape = plan_shape(ArraySource(lengths, counts).summaries, data, batching)
    cuts = np.asarray(shape.cuts)
    group = np.searchsorted(cuts, np.arange(n), side="right") - 1
    blocks = group * (n + 1) + (np.arange(n) - cuts[group]) // block_samples(batching)
    served = np.concatenate([p.ids for p in plans])
    left = np.unique(np.concatenate([p.remainder for p in plans if p.remainder is not None]))
    # drop_last=False: every sample once (split batches are only ever cut, never repeated), but for
    # the reported remainder: in batch_size mode only where some group has too few samples for one
    # more batch a rank; a token budget's counts are estimated (Batching's doc), so a rare surplus.
    assert np.unique(served).size == served.size and np.intersect1d(served, left).size == 0
    assert np.array_equal(np.sort(np.concatenate([served, left])), np.arange(n))
    assert len({p.batches_per_rank for p in plans}) == 1
    if left.size and budget is None:
        per = data.dp_size // data.num_groups
        assert plans[0].batches_per_rank == int((np.diff(cuts) // per).min()), "only an infeasible count drops"
    for p in plans:
        of_batch = [set(blocks[p.ids[a:b]].tolist()) for a, b in zip(p.offsets[:-1], p.offsets[1:])]
        assert all(len(s) <= 1 for s in of_batch)  # one block's samples a batch
        # In step order, a rank leaves a block for good: its blocks come one after another.
        seq = [next(iter(s)) for s in of_batch if s]
        changes = [a for a, b in zip(seq, seq[1:]) if a != b]
        assert len(changes) == len(set(seq)) - 1


def test_batch_size_counts_stay_exact_and_fingerprints_unset_are_unchanged():
    lengths = np.random.default_rng(0).integers(1, 500, 10_001)
    counts = np.full(7, 10_001 // 7)
    counts[-1] += 10_001 - counts.sum()
    plain = Batching(batch_size=16, seed=3)
    blocked = Batching(batch_size=16, seed=3, shuffle_block=1000)
    _, a = _plans(lengths, counts, Layout(1, 1), plain)
    _, b = _plans(lengths, counts, Layout(1, 1), blocked)
    assert a[0].batches_per_rank == b[0].batches_per_rank == -(-10_001 // 16)
    assert block_samples(blocked) == 1008  # whole batches: every block's batches are full
    assert Batching(batch_size=16, seed=3, shuffle_block=None).fingerprint() == plain.fingerprint()
    assert blocked.fingerprint() != plain.fingerprint()
    with pytest.raises(ValueError, match="shuffle=True"):
        Batching(batch_size=16, shuffle=False, shuffle_block=10)
    with pytest.raises(ValueError, match="shuffle_block"):
        Batching(batch_size=16, shuffle_block=0)


@pytest.mark.parametrize("ranks", [1, 8])
def test_real_documents_a_pass_reads_its_blocks_in_turn_with_little_padding(ranks):
    # Real shapes: stdlib files and /usr/share/doc text as byte counts, in storage order.
    lengths = np.concatenate([stdlib_lengths(), doc_lengths()])
    lengths = np.minimum(lengths, 65536)
    n = lengths.size
    counts = np.diff(np.linspace(0, n, 40).astype(np.int64))
    block = int(counts.mean())  # about a shard's samples
    full = Batching(max_tokens=65536, seed=1)
    blocked = Batching(max_tokens=65536, seed=1, shuffle_block=block)
    eff = {}
    for name, b in (("full", full), ("block", blocked)):
        _, plans = _plans(lengths, counts, Layout(1, ranks), b)
        pad = sum(
            int(p.lengths[p.offsets[i] : p.offsets[i + 1]].max(initial=0)) * int(p.offsets[i + 1] - p.offsets[i])
            for p in plans
            for i in range(p.batches_per_rank)
        )
        eff[name] = sum(int(p.lengths.sum()) for p in plans) / pad
        if name == "block":
            # The pass's first eight batches (a block holds ~36 here, about a 39th of the batches
            # wherever the corpus is larger) read one block of neighbours, two at most: 3 shards.
            steps = min(max(1, 8 // ranks), plans[0].batches_per_rank)
            first = np.concatenate([p.ids[: p.offsets[steps]] for p in plans])
            shard_of = np.searchsorted(np.cumsum(counts), first, side="right")
            assert len(set(shard_of.tolist())) <= 3
    # Bucketing within a block sorts fewer neighbours: padding costs a little, not a lot.
    assert eff["block"] >= eff["full"] - 0.05
