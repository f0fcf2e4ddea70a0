"""End-to-end properties of ShardedLoader over small packed datasets.

World sizes 1-4 are simulated by one loader per rank in this process, with explicit
rank / world_size / ranks_per_node. The planner's own properties are tested on its branch;
these test the glue: what the loader reads, in which order, and where it resumes.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from shardtool.format import open_dataset
from shardtool.loader import LoaderStateError, ShardedLoader
from shardtool.plan import sample_locations
from shardtool.plan.synthetic import lognormal_lengths
from test_loader_data import read_all, write_dataset

SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_DATASETS: dict = {}


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    base = tmp_path_factory.mktemp("loader-props")

    def get(shards: tuple[int, ...], fmt: str, seed: int):
        key = (shards, fmt, seed)
        if key not in _DATASETS:
            _DATASETS[key] = write_dataset(
                str(base / f"{fmt}-{seed}-{'-'.join(map(str, shards))}"), list(shards), fmt=fmt, seed=seed
            )
        return _DATASETS[key]

    return get


shard_sizes = st.lists(st.integers(0, 25), min_size=1, max_size=4).filter(lambda s: sum(s) >= 16).map(tuple)
layouts = st.sampled_from([(1, 1), (2, 1), (2, 2), (3, 1), (4, 2), (4, 1)])  # (world_size, ranks_per_node)
batchings = st.one_of(
    st.builds(lambda b: {"batch_size": b}, st.integers(1, 5)),
    st.builds(lambda t: {"max_tokens": t}, st.integers(40, 120)),
)


def make(root, world, rpn, batching, **kw):
    return [ShardedLoader(root, rank=r, world_size=world, ranks_per_node=rpn, **batching, **kw) for r in range(world)]


def plannable(root, world, rpn, batching, **kw):
    try:
        return make(root, world, rpn, batching, **kw)
    except ValueError as e:  # dataset too small to give every rank a batch
        assume("too small" not in str(e))
        raise


@SETTINGS
@given(
    shards=shard_sizes,
    fmt=st.sampled_from(["tar", "arrow"]),
    layout=layouts,
    batching=batchings,
    seed=st.integers(0, 3),
    epoch=st.integers(0, 3),
)
def test_every_sample_once_per_epoch_except_the_remainder(datasets, shards, fmt, layout, batching, seed, epoch):
    root, keys = datasets(shards, fmt, 0)
    loaders = plannable(root, *layout, batching, seed=seed, num_workers=0)
    for ld in loaders:
        ld.set_epoch(epoch)
        ld.plan  # noqa: B018 - plans the epoch
    n = len(loaders[0])
    # Each rank knows its data group's remainder; read before the pass (then it is the next epoch's).
    remainder = [keys[i] for i in sorted(set().union(*(ld.remainder.tolist() for ld in loaders)))]
    assert all(len(ld) == n for ld in loaders), "every rank knows the same batch count up front"
    seen = []
    for ld in loaders:
        batches = read_all(ld)
        assert len(batches) == n
        seen += [k for b in batches for k in b]
    assert len(seen) == len(set(seen)), "no sample twice"
    assert sorted(seen + remainder) == sorted(keys)
    assert {json.dumps(ld.state_dict()) for ld in loaders} == {json.dumps(loaders[0].state_dict())}


@SETTINGS
@given(
    shards=shard_sizes,
    fmt=st.sampled_from(["tar", "arrow"]),
    layout=layouts,
    batching=batchings,
    workers=st.sampled_from([1, 2]),
)
def test_batch_sequence_does_not_depend_on_num_workers(datasets, shards, fmt, layout, batching, workers):
    root, _ = datasets(shards, fmt, 1)
    assume(_fits(root, layout, batching))
    world, rpn = layout
    seqs = []
    for nw in (0, workers):
        ld = ShardedLoader(
            root, rank=world - 1, world_size=world, ranks_per_node=rpn, **batching, num_workers=nw, seed=5
        )
        seqs.append([(b["__key__"], b["tokens"].tolist(), b["lengths"].tolist(), b["meta"], b["bin"]) for b in ld])
    assert seqs[0] == seqs[1]


def _fits(root, layout, batching) -> bool:
    try:
        ShardedLoader(root, rank=0, world_size=layout[0], ranks_per_node=layout[1], **batching, num_workers=0).plan
        return True
    except ValueError:
        return False


@SETTINGS
@given(
    shards=shard_sizes,
    fmt=st.sampled_from(["tar", "arrow"]),
    layout=layouts,
    batching=batchings,
    cut=st.floats(0, 1),
    workers=st.sampled_from([(0, 0), (0, 2), (2, 0)]),
)
def test_resume_yields_the_tail_of_the_uninterrupted_run(datasets, shards, fmt, layout, batching, cut, workers):
    root, _ = datasets(shards, fmt, 2)
    assume(_fits(root, layout, batching))
    world, rpn = layout
    full = [read_all(ld) for ld in make(root, world, rpn, batching, num_workers=0, seed=3)]
    n = len(full[0])
    k = int(round(cut * n))
    first = make(root, world, rpn, batching, num_workers=workers[0], seed=3)
    states = []
    for ld in first:
        it = iter(ld)
        for _ in range(k):
            next(it)
        states.append(json.loads(json.dumps(ld.state_dict())))
        it.close()
    assert all(s == states[0] for s in states), "state is identical on every rank"
    resumed = make(root, world, rpn, batching, num_workers=workers[1], seed=3)
    for r, ld in enumerate(resumed):
        ld.load_state_dict(states[r])
        ld.set_epoch(states[r]["epoch"])  # the usual training loop calls this; it keeps the position
        if k == n:  # a finished epoch resumes at the next one, from its start
            assert states[r]["epoch"] == 1 and len(ld) == len(ld.plan.batches())
        else:
            assert len(ld) == n and ld.batches_left == n - k  # len: the whole epoch, as a trainer counts
            assert read_all(ld) == full[r][k:]


@SETTINGS
@given(shards=shard_sizes, layout=layouts, new_layout=layouts, batching=batchings, cut=st.floats(0, 1))
def test_elastic_resume_serves_each_remaining_sample_once(datasets, shards, layout, new_layout, batching, cut):
    root, keys = datasets(shards, "tar", 3)
    assume(_fits(root, layout, batching))
    world, rpn = layout
    before = make(root, world, rpn, batching, num_workers=0)
    k = int(cut * len(before[0]))
    assume(k < len(before[0]))
    served = []
    for ld in before:
        it = iter(ld)
        for _ in range(k):
            served += next(it)["__key__"]
        it.close()
    state = before[0].state_dict()
    after = [
        ShardedLoader(root, rank=r, world_size=new_layout[0], ranks_per_node=new_layout[1], **batching, num_workers=0)
        for r in range(new_layout[0])
    ]
    for ld in after:
        ld.load_state_dict(state)
    # Not served this epoch: the remainder of its plan (the first layout's, or the new one's when
    # nothing had been served yet), and the batches the re-deal left over (fewer than the new world).
    planned = after if after[0].plan.remainder is not None else before
    left = [keys[i] for i in sorted(set().union(*(ld.remainder.tolist() for ld in planned)))]
    leftover = after[0].planner.left_over(after[0].batch_source.state)
    assert len(leftover) < new_layout[0]
    left += [keys[i] for b in leftover for i in b.tolist()]
    counts = set()
    for ld in after:
        batches = read_all(ld)
        counts.add(len(batches))
        served += [k for b in batches for k in b]
    assert len(counts) == 1
    assert len(served) == len(set(served)), "no sample served twice across the resize"
    assert sorted(served + left) == sorted(keys)


def test_default_batch_matches_dataset_read(tmp_path):
    for fmt in ("tar", "arrow"):
        root, keys = write_dataset(str(tmp_path / fmt), [7, 0, 9, 5], fmt=fmt)
        ds = open_dataset(root)
        for batch in ShardedLoader(root, batch_size=4, num_workers=0, pad_id=-1):
            assert set(batch) == {"__key__", "tokens", "lengths", "text", "meta", "bin"}
            assert batch["tokens"].dtype == torch.int64 and 1 <= batch["tokens"].shape[0] <= 4
            for r, key in enumerate(batch["__key__"]):
                (s,), (i,) = sample_locations(ds.shard_counts, [keys.index(key)])
                ref = ds.read(int(s), int(i))
                n = int(batch["lengths"][r])
                assert np.array_equal(batch["tokens"][r, :n].numpy(), ref["tokens"])
                assert (batch["tokens"][r, n:] == -1).all()
                assert (batch["text"][r], batch["meta"][r], batch["bin"][r]) == (ref["text"], ref["meta"], ref["bin"])


def test_transform_and_collate_fn(tmp_path):
    root, _ = write_dataset(str(tmp_path / "d"), [10, 10])
    plain = [b["__key__"] for b in ShardedLoader(root, batch_size=3, num_workers=0)]
    up = ShardedLoader(root, batch_size=3, num_workers=1, transform=lambda s: {**s, "__key__": s["__key__"].upper()})
    assert [b["__key__"] for b in up] == [[k.upper() for k in b] for b in plain]
    keys_only = ShardedLoader(root, batch_size=3, num_workers=0, collate_fn=lambda ss: [s["__key__"] for s in ss])
    assert list(keys_only) == plain


def test_shuffling_is_deterministic_and_changes_with_epoch_and_seed(tmp_path):
    root, _ = write_dataset(str(tmp_path / "d"), [40, 40])
    a = read_all(ShardedLoader(root, batch_size=4, num_workers=0, seed=1))
    assert a == read_all(ShardedLoader(root, batch_size=4, num_workers=0, seed=1))
    assert a != read_all(ShardedLoader(root, batch_size=4, num_workers=0, seed=2))
    ld = ShardedLoader(root, batch_size=4, num_workers=0, seed=1)
    ld.set_epoch(1)
    assert read_all(ld) != a


def test_epoch_end_state_says_next_epoch(tmp_path):
    root, _ = write_dataset(str(tmp_path / "d"), [20, 13])
    ld = ShardedLoader(root, batch_size=4, num_workers=0)
    n = len(ld)
    states = [ld.state_dict() for _ in ld]
    assert states[-1]["epoch"] == 1 and states[-1]["segments"][-1]["served"] == 0
    assert states[-2]["epoch"] == 0 and states[-2]["segments"][-1]["served"] == n - 1
    assert ld.epoch == 1 and ld.state_dict() == states[-1]
    fresh = ShardedLoader(root, batch_size=4, num_workers=0)
    fresh.load_state_dict(states[-1])
    fresh.set_epoch(1)
    nxt = ShardedLoader(root, batch_size=4, num_workers=0)
    nxt.set_epoch(1)
    assert read_all(fresh) == read_all(nxt)


def test_state_from_another_dataset_or_batching_is_refused(tmp_path):
    root, _ = write_dataset(str(tmp_path / "a"), [20, 13])
    other, _ = write_dataset(str(tmp_path / "b"), [20, 13], seed=9)
    ld = ShardedLoader(root, batch_size=4, num_workers=0)
    sd = ld.state_dict()
    with pytest.raises(LoaderStateError, match="another dataset"):
        ShardedLoader(other, batch_size=4, num_workers=0).load_state_dict(sd)
    it = iter(ld)
    next(it)
    with pytest.raises(LoaderStateError, match="batching"):  # a position inside an epoch
        ShardedLoader(root, batch_size=5, num_workers=0).load_state_dict(ld.state_dict())
    at_start = ShardedLoader(root, batch_size=5, num_workers=0)  # an epoch's start: planned with this batching
    at_start.load_state_dict(sd)
    assert at_start.epoch == 0 and len(at_start) == len(ShardedLoader(root, batch_size=5, num_workers=0))
    with pytest.raises(LoaderStateError):
        ShardedLoader(root, batch_size=4, num_workers=0).load_state_dict({"epoch": 1})


def test_exactly_one_of_batch_size_and_max_tokens(tmp_path):
    root, _ = write_dataset(str(tmp_path / "d"), [5])
    with pytest.raises(ValueError, match="exactly one"):
        ShardedLoader(root, num_workers=0)
    with pytest.raises(ValueError, match="exactly one"):
        ShardedLoader(root, batch_size=2, max_tokens=100, num_workers=0)


def test_padding_efficiency_on_lognormal_tokens(tmp_path):
    lengths = lognormal_lengths(12000)
    root, _ = write_dataset(str(tmp_path / "d"), [3000] * 4, lengths=lengths, extra=False, dtype="u2")
    ld = ShardedLoader(root, max_tokens=65536, num_workers=0)
    assert ld.padding_efficiency >= 0.95
    real = padded = 0
    for b in ld:
        assert b["tokens"].numel() <= 65536
        real += int(b["lengths"].sum())
        padded += b["tokens"].numel()
    assert real / padded >= 0.95


def test_pad_id_outside_the_stored_dtype_is_still_exact(tmp_path):
    # int16 tokens padded with an id int16 cannot hold: rows are widened one by one instead.
    root, keys = write_dataset(str(tmp_path / "d"), [6, 5, 7], dtype="i2")
    ds = open_dataset(root)
    seen = 0
    for batch in ShardedLoader(root, max_tokens=64, num_workers=0, pad_id=70000):
        for r, key in enumerate(batch["__key__"]):
            (s,), (i,) = sample_locations(ds.shard_counts, [keys.index(key)])
            n = int(batch["lengths"][r])
            assert np.array_equal(batch["tokens"][r, :n].numpy(), ds.read(int(s), int(i))["tokens"])
            assert (batch["tokens"][r, n:] == 70000).all()
            seen += 1
    assert seen > 0
