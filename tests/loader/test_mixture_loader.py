"""ShardedLoader(Mixture(...)): batches of several datasets, their sources, and resume across phases.

Ranks are simulated by one loader per rank in this process (explicit rank / world_size), as in
test_loader.py; real processes are in test_mixture_ddp.py.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardtool.format import open_dataset
from shardtool.loader import LoaderStateError, ShardedLoader
from shardtool.plan.mixture import Mixture
from shardtool.plan.mixture.span import RepeatError
from test_loader_data import write_dataset

VOCAB = 30000  # write_dataset's: sample g's tokens are (arange(n) + 7 g) % VOCAB
SOURCES = {"web": [300, 200, 250], "code": [120, 80], "math": [60, 40], "new": [70, 50]}
BUCKETED = dict(max_tokens=160)
PACKED = dict(seq_len=64, batch_size=4, packing="best-fit")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    base = tmp_path_factory.mktemp("mixture")
    out = {}
    for i, (name, shards) in enumerate(SOURCES.items()):
        root, keys = write_dataset(str(base / name), shards, seed=i, prefix=name[0], extra=name == "web")
        out[name] = (root, keys, open_dataset(root).lengths)
    return out


def mixture(data, weights: dict, **kw) -> Mixture:
    return Mixture({n: (data[n][0], w) for n, w in weights.items()}, **kw)


WEIGHTS = {"web": 0.6, "code": 0.3, "math": 0.1}


def loaders(mix, world=2, steps=120, **kw):
    kw = {"num_workers": 0, "seed": 5, **kw}
    return [ShardedLoader(mix, steps=steps, rank=r, world_size=world, ranks_per_node=1, **kw) for r in range(world)]


def keys_of(batch):
    keys = batch["__key__"]
    return [tuple(k) for k in keys] if keys and isinstance(keys[0], list) else list(keys)


def run(loader, stop: int | None = None):
    """(source, keys) of every batch one pass yields (up to step ``stop``), and the state after."""
    got = []
    if stop != loader.step:
        for batch in loader:
            got.append((batch["__source__"], keys_of(batch)))
            if loader.step == stop:
                break
    return got, json.loads(json.dumps(loader.state_dict()))


# ---------------------------------------------------------------------- batches
def test_a_bucketed_batch_is_one_sources_batch_and_says_which(data):
    (ld,) = loaders(mixture(data, WEIGHTS), world=1, **BUCKETED)
    assert len(ld) == 120
    batches = list(ld)
    assert len(batches) == 120 and ld.batches_left == 0  # the run is over
    seen = {n: 0 for n in WEIGHTS}
    for b in batches:
        name = b["__source__"]
        assert all(k.startswith(name[0]) for k in b["__key__"])
        assert b["per_source"] == {n: int(n == name) for n in WEIGHTS}
        assert b["per_source_tokens"] == {n: int(b["lengths"].sum()) if n == name else 0 for n in WEIGHTS}
        seen[name] += 1
    assert all(seen.values()) and seen["web"] > seen["math"]
    assert set(batches[0]) >= {"__key__", "tokens", "lengths", "__source__", "per_source"}


def test_packed_rows_of_several_sources_share_one_batch_of_static_shape(data):
    (ld,) = loaders(mixture(data, WEIGHTS), world=1, steps=60, **PACKED)
    maxd = ld.packing.max_docs_per_row
    mixed = 0
    for b in ld:
        ids, pos, labels, cu = (
            b["input_ids"].numpy(),
            b["position_ids"].numpy(),
            b["labels"].numpy(),
            b["cu_seqlens"].numpy(),
        )
        assert ids.shape == (4, 64) and cu.shape == (4 * maxd + 1,)
        assert sum(b["per_source"].values()) == 4 and len(b["__source__"]) == 4
        mixed += len(set(b["__source__"])) > 1
        flat_pos = pos.reshape(-1)
        starts = np.flatnonzero(flat_pos == 0)
        assert (cu[: len(starts)] == starts).all() and (cu[len(starts) :] == 4 * 64).all()
        for r in range(4):
            name, keys, real = b["__source__"][r], b["__key__"][r], int(b["lengths"][r])
            assert all(k.startswith(name[0]) for k in keys)
            # Each piece is a run of one document's tokens: (start + 7 g) % VOCAB, +1 per token.
            piece_starts = list(np.flatnonzero(pos[r][:real] == 0)) + [real]
            assert len(piece_starts) - 1 == len(keys)
            for (a, z), key in zip(zip(piece_starts, piece_starts[1:]), keys):
                g = int(key[1:])
                run_ = ids[r, a:z]
                assert (np.diff(run_) % VOCAB == 1).all()
                assert (int(run_[0]) - 7 * g) % VOCAB + len(run_) <= data[name][2][g]  # a span of document g
                assert (labels[r, a : z - 1] == run_[1:]).all() and labels[r, z - 1] == -100
            assert (labels[r, real:] == -100).all()
        assert b["per_source_tokens"] == {
            n: int(b["lengths"][[s == n for s in b["__source__"]]].sum()) for n in WEIGHTS
        }
    assert mixed > 10  # rows of several sources in one batch, most steps


# Rows of 8192 tokens: a batch's arrays outgrow the worker's first 1 MiB slot mid-batch (once
# killed the worker with SIGSEGV: the arrays written before the slot grew lost their mapping).
BIG_PACKED = dict(seq_len=8192, batch_size=8, packing="best-fit")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "kind,steps", [(BUCKETED, 50), (PACKED, 50), (BIG_PACKED, 4)], ids=["bucketed", "packed", "packed-8192"]
)
def test_batch_sequence_does_not_depend_on_num_workers(data, kind, steps):
    mix = mixture(data, WEIGHTS, max_repeat=1000)
    base = [run(ld)[0] for ld in loaders(mix, num_workers=0, steps=steps, **kind)]
    assert [run(ld)[0] for ld in loaders(mix, num_workers=2, prefetch_factor=3, steps=steps, **kind)] == base


# ---------------------------------------------------------------------- resume
@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(kind=st.sampled_from(["bucketed", "packed"]), cut=st.integers(0, 90), workers=st.sampled_from([(0, 0), (0, 2)]))
def test_kill_and_resume_at_any_step_gives_the_same_batches(data, kind, cut, workers):
    batching = BUCKETED if kind == "bucketed" else PACKED
    mix = mixture(data, WEIGHTS)
    full = [run(ld)[0] for ld in loaders(mix, steps=90, **batching)]
    halves = [run(ld, stop=cut) for ld in loaders(mix, steps=90, num_workers=workers[0], **batching)]
    states = [s for _, s in halves]
    assert all(s == states[0] for s in states) and states[0]["step"] == cut
    for r, ld in enumerate(loaders(mix, steps=90, num_workers=workers[1], **batching)):
        ld.load_state_dict(states[r])
        assert len(ld) == 90 and ld.batches_left == 90 - cut
        rest, _ = run(ld)
        assert halves[r][0][:cut] + rest == full[r]


def unit_keys(loader, data, name: str, count: int) -> list[list]:
    """The first ``count`` units of ``name`` on ``loader``'s DP rank, epoch after epoch, as the
    source's own single-dataset plan gives them (the reference a mixture must follow)."""
    planner = loader.planner.planners[name]
    keys = data[name][1]
    out, epoch = [], 0
    while len(out) < count:
        plan = planner.rank_plan(
            planner.start(epoch, loader.datasets[name].version, loader.data_layout), loader.dp_rank
        )
        out += [[keys[g] for g in plan.batch(i)] for i in range(plan.batches_per_rank)]
        epoch += 1
    return out[:count]


def per_source(batches) -> dict[str, list]:
    out: dict = {}
    for name, keys in batches:
        out.setdefault(name, []).append(keys)
    return out


def test_weights_changed_at_resume_serve_every_source_as_a_contiguous_prefix_of_its_plan(data):
    first = loaders(mixture(data, WEIGHTS), steps=200, **BUCKETED)
    halves = [run(ld, stop=70) for ld in first]
    changed = mixture(
        data,
        {"web": 0.1, "code": 0.2, "math": 0.7},
        schedule=[(150, {"web": 0.5, "code": 0.5, "math": 0})],
        max_repeat=50,
    )
    for r, ld in enumerate(loaders(changed, steps=200, **BUCKETED)):
        ld.load_state_dict(halves[r][1])
        report = ld.report()
        assert report["phase_from_step"] == 70 and report["phases_before"] == 1
        rest, _ = run(ld)
        assert len(rest) == 130
        served = per_source(halves[r][0] + rest)
        for name, got in served.items():
            assert got == unit_keys(ld, data, name, len(got)), name  # no repeat, no skip
        math_after = sum(1 for n, _ in rest[:80] if n == "math")
        assert math_after > 40 and not any(n == "math" for n, _ in rest[80:])  # the new weights, then 0


def test_a_source_added_at_resume_starts_at_its_beginning(data):
    halves = [run(ld, stop=40) for ld in loaders(mixture(data, WEIGHTS), steps=150, **BUCKETED)]
    grown = mixture(data, {"web": 0.4, "new": 0.4, "math": 0.2})  # code removed, new added
    for r, ld in enumerate(loaders(grown, steps=150, **BUCKETED)):
        ld.load_state_dict(halves[r][1])
        rest, _ = run(ld)
        assert not any(n == "code" for n, _ in rest)
        new = per_source(rest)["new"]
        assert new == unit_keys(ld, data, "new", len(new))  # from its first unit
        for name in ("web", "math"):
            got = per_source(halves[r][0] + rest)[name]
            assert got == unit_keys(ld, data, name, len(got))


def test_elastic_resume_from_three_ranks_to_two_serves_no_sample_twice(data):
    mix = mixture(data, {"web": 0.5, "code": 0.5})
    steps = 16  # within every source's first epoch, on both layouts
    three = loaders(mix, world=3, steps=steps, **BUCKETED)
    halves = [run(ld, stop=steps // 2) for ld in three]
    two = loaders(mix, world=2, steps=steps, **BUCKETED)
    served = [k for r in halves for _, keys in r[0] for k in keys]
    for ld in two:
        ld.load_state_dict(halves[0][1])
        assert ld.report()["phases_before"] == 1
        rest, _ = run(ld)
        assert len(rest) == steps - steps // 2
        served += [k for _, keys in rest for k in keys]
        assert set(ld.source_epochs.values()) == {0}
    assert len(served) == len(set(served)), "a sample was served twice across the resize"


def test_packed_elastic_resume_serves_no_token_twice(data):
    mix = mixture(data, {"web": 0.5, "code": 0.5}, max_repeat=20)
    tokens = {}

    def add(loader, steps):
        for t in steps:
            for name, pieces in loader.planner.step_pieces(loader.batch_source.state, t):
                for epoch, first, count in pieces:
                    plan = loader.planner.rank_plan(loader.batch_source.state, name, epoch, loader.dp_rank)
                    rows = plan.rows.take(np.arange(plan.row_offsets[first], plan.row_offsets[first + count]))
                    acc = tokens.setdefault((name, epoch), np.zeros(len(data[name][1]), np.int64))
                    np.add.at(acc, rows.span_pos, rows.span_len)

    three = loaders(mix, world=3, steps=120, **PACKED)
    for ld in three:
        run(ld, stop=50)
        add(ld, range(50))
    state = three[0].state_dict()
    for ld in loaders(mix, world=2, steps=120, **PACKED):
        ld.load_state_dict(state)
        got, _ = run(ld)
        assert len(got) == 70
        add(ld, range(50, 120))
    assert len({e for _, e in tokens}) > 1
    for (name, _), acc in tokens.items():
        assert (acc <= data[name][2]).all(), name


# ---------------------------------------------------------------------- length, refusals
def test_length_is_steps_and_a_mixture_has_no_epoch(data):
    (ld,) = loaders(mixture(data, WEIGHTS), world=1, steps=30, **BUCKETED)
    it = iter(ld)
    for _ in range(10):
        next(it)
    it.close()
    assert ld.step == 10 and len(ld) == 30 and ld.batches_left == 20  # len: the whole run, as a trainer counts
    assert len(list(ld)) == 20 and len(ld) == 30 and ld.batches_left == 0 and list(ld) == []
    with pytest.raises(LoaderStateError, match="a mixture has no epoch"):
        ld.set_epoch(1)
    with pytest.raises(AttributeError, match="no epoch"):
        ld.epoch  # noqa: B018
    by_tokens = ShardedLoader(mixture(data, WEIGHTS), tokens=20_000, num_workers=0, **BUCKETED)
    expected = sum(s["tokens_in_phase"] for s in by_tokens.report()["per_source"].values())
    assert by_tokens.steps > 0 and expected == 0
    list(by_tokens)
    got = sum(s["tokens_in_phase"] for s in by_tokens.report()["per_source"].values())
    assert 20_000 <= got < 20_000 + 2 * 160


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(), "exactly one of steps= .* and tokens="),
        (dict(steps=10, tokens=10), "exactly one of steps="),
        (dict(steps=0), "steps must be an int >= 1"),
    ],
)
def test_a_mixture_needs_its_length(data, kw, match):
    with pytest.raises(ValueError, match=match):
        ShardedLoader(mixture(data, WEIGHTS), num_workers=0, **BUCKETED, **kw)


def test_steps_for_one_dataset_are_refused(data):
    with pytest.raises(ValueError, match="steps= and tokens= give the length of a Mixture"):
        ShardedLoader(data["web"][0], steps=10, max_tokens=160)


def test_more_passes_than_max_repeat_are_refused_at_construction_with_a_table(data):
    mix = mixture(data, {"web": 0.2, "math": 0.8}, max_repeat=3)
    with pytest.raises(RepeatError) as err:
        ShardedLoader(mix, steps=400, num_workers=0, **BUCKETED)
    text = str(err.value)
    assert "'math' more than max_repeat=3" in text and "tokens needed" in text and "> max_repeat" in text
    ShardedLoader(mix, steps=10, num_workers=0, **BUCKETED)  # a short run is fine


def test_states_of_the_other_kind_or_another_dataset_are_refused(data, tmp_path):
    (ld,) = loaders(mixture(data, WEIGHTS), world=1, steps=50, **BUCKETED)
    _, state = run(ld, stop=20)
    single = ShardedLoader(data["web"][0], max_tokens=160, num_workers=0)
    with pytest.raises(LoaderStateError, match="saved by a loader of a Mixture"):
        single.load_state_dict(state)
    with pytest.raises(LoaderStateError, match="single-dataset"):
        ld.load_state_dict(single.state_dict())
    (short,) = loaders(mixture(data, WEIGHTS), world=1, steps=10, **BUCKETED)
    with pytest.raises(LoaderStateError, match="past steps=10"):
        short.load_state_dict(state)
    # The same path, other data: a new dataset version, refused with found/expected.
    moved = tmp_path / "code"
    write_dataset(str(moved), [100, 100], seed=99, prefix="c")
    other = Mixture({"web": (data["web"][0], 0.6), "code": (str(moved), 0.3), "math": (data["math"][0], 0.1)})
    (changed,) = loaders(other, world=1, steps=50, **BUCKETED)
    with pytest.raises(LoaderStateError, match=r"source 'code' is another dataset .*found version .* expected"):
        changed.load_state_dict(state)


def test_transform_and_collate_fn_apply_to_every_source(data):
    mix = mixture(data, WEIGHTS)
    seen = []

    def transform(sample):
        seen.append(sample["__key__"][0])
        return {"__key__": sample["__key__"], "n": len(sample["tokens"])}

    (ld,) = loaders(mix, world=1, steps=20, transform=transform, collate_fn=lambda s: [x["n"] for x in s], **BUCKETED)
    batches = list(ld)
    assert all(isinstance(b, list) for b in batches) and len(batches) == 20
    assert set(seen) == {"w", "c", "m"}


def test_a_cache_dir_holds_every_source_and_serves_without_them(data, tmp_path):
    roots = {n: str(tmp_path / n) for n in WEIGHTS}
    for n in WEIGHTS:
        shutil.copytree(data[n][0], roots[n])
    mix = Mixture({n: (roots[n], w) for n, w in WEIGHTS.items()})
    cache = str(tmp_path / "cache")
    expected = [run(ld)[0] for ld in loaders(mix, steps=40, **BUCKETED)]
    assert [run(ld)[0] for ld in loaders(mix, steps=40, cache_dir=cache, **BUCKETED)] == expected  # fetched
    for n in WEIGHTS:
        shutil.move(roots[n], roots[n] + "-gone")
    assert [run(ld)[0] for ld in loaders(mix, steps=40, cache_dir=cache, num_workers=2, **BUCKETED)] == expected


def test_sources_storing_tokens_in_other_dtypes_give_the_same_packed_batches(data, tmp_path):
    """Rows of sources of one token dtype are read in one pass; of several dtypes, source by
    source into one block. Both give the same batch."""
    root, _ = write_dataset(str(tmp_path / "code16"), SOURCES["code"], seed=1, prefix="c", dtype="i2")
    same = mixture(data, {"web": 0.5, "code": 0.5})
    other = Mixture({"web": (data["web"][0], 0.5), "code": (root, 0.5)})
    a = list(loaders(same, world=1, steps=30, **PACKED)[0])
    b = list(loaders(other, world=1, steps=30, **PACKED)[0])
    assert any(len(set(x["__source__"])) > 1 for x in a)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            if hasattr(x[k], "numpy"):
                assert torch.equal(x[k], y[k]), k
            else:
                assert x[k] == y[k], k


def test_model_parallel_peers_of_a_dp_rank_get_identical_batches(data):
    mix = mixture(data, WEIGHTS)
    lds = [
        ShardedLoader(mix, steps=30, rank=r, world_size=4, ranks_per_node=4, dp_size=2, num_workers=0, seed=5, **PACKED)
        for r in range(4)
    ]
    got = {}
    for ld in lds:
        got.setdefault(ld.dp_rank, []).append(run(ld)[0])
    assert sorted(got) == [0, 1] and all(len(v) == 2 for v in got.values())
    for peers in got.values():
        assert peers[0] == peers[1]
    assert got[0][0] != got[1][0]


# ---------------------------------------------------------------------- metrics
@pytest.mark.timeout(120)
@pytest.mark.parametrize("config", [BUCKETED, PACKED], ids=["bucketed", "packed"])
@pytest.mark.parametrize("workers", [0, 2])
def test_metrics_count_each_sources_tokens_as_the_batches_carry_them(data, config, workers):
    """The metrics of a mixture say how many tokens of each source were trained on: what the
    batches' per_source_tokens add up to, in the cumulative and the window view alike."""
    (ld,) = loaders(mixture(data, WEIGHTS), world=1, steps=40, num_workers=workers, **config)
    want = {n: 0 for n in WEIGHTS}
    first = None
    for batch in ld:
        for n, t in batch["per_source_tokens"].items():
            want[n] += t
        if ld.step == 10:
            first = ld.metrics()
    m = ld.metrics()
    assert m["cumulative"]["batches"] == 40
    assert m["cumulative"]["tokens_by_source"] == want
    assert m["cumulative"]["tokens"] == sum(want.values())
    assert {n: first["cumulative"]["tokens_by_source"][n] + m["window"]["tokens_by_source"][n] for n in want} == want
    assert 0 < m["cumulative"]["padding_efficiency"] <= 1
    read = m["cumulative"]["bytes_read"]
    assert read["local"] > 0  # every source's reader counts into the one probe
    ld.close()
