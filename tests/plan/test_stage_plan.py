"""In-job staging's decisions (shardtool.plan.stageorder): the touch order of a rank's plan and of a
node, and the window of shards the stager may fetch ahead of its slowest reader."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardtool.plan import Batching, Layout, Placement, Planner, data_parallel
from shardtool.plan.stageorder import (
    TouchOrder,
    merge_orders,
    next_fetches,
    touch_order,
    window_end,
)


@st.composite
def plans(draw):
    """(ids, offsets, shard_offsets): batches of global sample ids over some shards."""
    counts = draw(st.lists(st.integers(0, 6), min_size=1, max_size=8))
    shard_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    n = int(shard_offsets[-1])
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(1, np.int64), shard_offsets
    ids = np.asarray(draw(st.lists(st.integers(0, n - 1), max_size=30)), np.int64)
    cuts = sorted(draw(st.lists(st.integers(0, ids.size), max_size=6)))
    offsets = np.asarray([0, *cuts, ids.size], np.int64)
    return ids, offsets, shard_offsets


def brute(ids, offsets, shard_offsets, start=0) -> dict[int, int]:
    first: dict[int, int] = {}
    for b in range(start, offsets.size - 1):
        for i in ids[offsets[b] : offsets[b + 1]]:
            s = int(np.searchsorted(shard_offsets, i, side="right") - 1)
            first.setdefault(s, b)
    return first


def as_dict(order: TouchOrder) -> dict[int, int]:
    return dict(zip(order.shards.tolist(), order.steps.tolist()))


@settings(max_examples=200, deadline=None)
@given(plans(), st.integers(0, 8))
def test_touch_order_is_each_shards_first_batch_sorted_by_step(plan, start):
    ids, offsets, shard_offsets = plan
    start = min(start, offsets.size - 1)
    order = touch_order(ids, offsets, shard_offsets, start)
    assert as_dict(order) == brute(ids, offsets, shard_offsets, start)
    assert len(set(order.shards.tolist())) == len(order)
    keys = list(zip(order.steps.tolist(), order.shards.tolist()))
    assert keys == sorted(keys)
    assert TouchOrder.from_dict(order.to_dict(3)).shards.tolist() == order.shards.tolist()


@settings(max_examples=100, deadline=None)
@given(st.lists(plans(), min_size=1, max_size=4))
def test_the_node_order_is_the_earliest_step_of_any_rank(ranks):
    merged = {}
    orders = []
    for ids, offsets, _ in ranks:
        shard_offsets = ranks[0][2]
        ids = ids[ids < shard_offsets[-1]]  # the ranks share one dataset
        offsets = np.minimum(offsets, ids.size)
        orders.append(touch_order(ids, offsets, shard_offsets))
        for s, b in brute(ids, offsets, shard_offsets).items():
            merged[s] = min(merged.get(s, b), b)
    assert as_dict(merge_orders(orders)) == merged


@st.composite
def windows(draw):
    n = draw(st.integers(0, 20))
    steps = np.sort(np.asarray(draw(st.lists(st.integers(0, 10), min_size=n, max_size=n)), np.int64))
    order = TouchOrder(np.asarray(draw(st.permutations(range(n))), np.int64), steps)
    sizes = draw(st.lists(st.integers(1, 100), min_size=n, max_size=n))
    present = set(draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=n))) if n else set()
    busy = set(draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=3))) if n else set()
    return order, sizes, present, busy


@settings(max_examples=300, deadline=None)
@given(windows(), st.integers(0, 12), st.integers(1, 6), st.one_of(st.none(), st.integers(1, 400)), st.integers(0, 5))
def test_fetches_are_the_first_missing_shards_of_the_window_and_never_beyond(w, slowest, ahead, ahead_bytes, slots):
    order, sizes, present, busy = w
    picks = next_fetches(
        order,
        sizes,
        slowest_step=slowest,
        present=present,
        busy=busy,
        ahead_shards=ahead,
        ahead_bytes=ahead_bytes,
        slots=slots,
    )
    end = window_end(order, sizes, slowest_step=slowest, ahead_shards=ahead, ahead_bytes=ahead_bytes)
    late = int(np.count_nonzero(order.steps <= slowest))
    # The window: every due shard, then at most `ahead` more, within the byte bound (one always).
    assert late <= end <= late + ahead
    if ahead_bytes is not None and end > late + 1:
        assert sum(sizes[s] for s in order.shards[late:end].tolist()) <= ahead_bytes
    if end < len(order) and end < late + ahead:
        assert ahead_bytes is not None  # cut short only by the byte bound
    missing = [s for s in order.shards[:end].tolist() if s not in present and s not in busy]
    assert picks == missing[: max(slots, 0)]


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 30), st.integers(1, 5), st.integers(1, 4), st.integers(1, 3), st.randoms())
def test_a_simulated_stager_keeps_its_bound_and_stages_everything(n, ahead, slots, per_step, rnd):
    """Readers advance when the shards of their step are in; the stager fetches what the window
    allows, some fetches take several ticks. Nothing is ever held beyond the bound; all arrive."""
    steps = np.sort(np.asarray([rnd.randrange(0, n) for _ in range(n)], np.int64))
    order = TouchOrder(np.arange(n, dtype=np.int64), steps)
    present: set[int] = set()
    busy: dict[int, int] = {}
    reader = 0
    for _ in range(20 * n + 50):
        for s in [s for s, left in busy.items() if left <= 1]:
            del busy[s]
            present.add(s)
        busy = {s: left - 1 for s, left in busy.items()}
        due = set(order.shards[order.steps <= reader].tolist())
        if due <= present and reader <= int(steps.max()):
            reader += per_step
        k = int(np.searchsorted(order.steps, reader, side="right"))
        for s in next_fetches(
            order,
            [1] * n,
            slowest_step=reader,
            present=present,
            busy=set(busy),
            ahead_shards=ahead,
            slots=slots - len(busy),
        ):
            assert order.shards.tolist().index(s) < k + ahead
            busy[s] = rnd.randrange(1, 4)
        # What is cached or in flight beyond the readers never exceeds the bound.
        assert len([s for s in present | set(busy) if order.steps[s] > reader]) <= ahead
        if len(present) == n:
            break
    assert len(present) == n


def test_a_real_plan_touches_the_shards_of_its_node_in_batch_order(tmp_path):
    from helpers.realtext import stdlib_lengths
    from shardtool.format import open_dataset
    from test_loader_data import write_dataset

    lengths = np.minimum(stdlib_lengths()[:600], 4096)  # real, heavy-tailed lengths, capped at a batch
    root, _ = write_dataset(str(tmp_path / "d"), [50] * 12, lengths=lengths, extra=False)
    ds = open_dataset(root)
    planner = Planner(ds, Batching(max_tokens=4096, seed=1))
    layout, _ = data_parallel(Placement(Layout(2, 2), 0, 0))
    state = planner.start(0, ds.version, layout)
    offs = ds.manifest.shard_offsets()
    orders = []
    for dp in (0, 1):  # node 0's ranks
        plan = planner.rank_plan(state, dp)
        order = touch_order(plan.ids, plan.offsets, offs)
        assert as_dict(order) == brute(plan.ids, plan.offsets, offs)
        orders.append(order)
    node = merge_orders(orders)
    assert set(node.shards.tolist()) <= set(range(12)) and len(node) >= 5  # about half the dataset
    assert node.steps[0] == 0


def test_ahead_must_be_positive():
    with pytest.raises(ValueError, match="ahead_shards"):
        next_fetches(
            TouchOrder(np.arange(2), np.arange(2)), [1, 1], slowest_step=0, present=set(), busy=set(), ahead_shards=0
        )
