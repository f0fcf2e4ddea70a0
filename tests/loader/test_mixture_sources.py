"""Mixtures as users change them, on real text (stdlib files as byte ids, one source zstd-compressed
and read in place): a mixture of one source, a source removed or added or reweighted at a resume
(said as a warning, the kept sources continuing), and close() in the middle of a pass freeing its
workers, shared memory and decompressed shards as a one-dataset loader's close() does."""

from __future__ import annotations

import json
import logging
import os

import pytest

import shardtool
from helpers.leaks import resources, settled
from helpers.realtext import byte_ids, stdlib_files
from shardtool.loader import ShardedLoader
from shardtool.plan.mixture import Mixture
from shardtool.plan.mixture.state import MixtureState, source_changes

PACKED = dict(seq_len=1024, batch_size=2)
BUCKETED = dict(batch_size=4)
CONFIGS = pytest.mark.parametrize("config", [PACKED, BUCKETED], ids=["packed", "bucketed"])


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """{name: root}: "lib" (300 stdlib files, plain) and "more" (the next 300, zstd-compressed)."""
    base = tmp_path_factory.mktemp("mixsrc")
    paths = stdlib_files(600)
    out = {}
    for name, part, comp in (("lib", paths[:300], None), ("more", paths[300:], "zstd")):
        rows = [{"tokens": byte_ids(p), "path": os.path.relpath(p)} for p in part]
        out[name] = str(base / name)
        shardtool.pack(rows, out[name], format="arrow", length="tokens", shard_size=2_000_000, compression=comp)
    return out


def _loader(sources, weights: dict, steps: int = 40, **kw) -> ShardedLoader:
    mix = Mixture({n: (sources[n], w) for n, w in weights.items()})
    return ShardedLoader(mix, steps=steps, **{"num_workers": 0, "seed": 3, "world_size": 1, "rank": 0, **kw})


def _keys(batch) -> list[str]:
    """ "source/key" of every sample (keys are per source: both count from 0) or piece of a batch."""
    keys, src = batch["__key__"], batch["__source__"]
    if keys and isinstance(keys[0], list):  # packed rows: a source per row
        return [f"{s}/{k}" for s, row in zip(src, keys) for k in row]
    return [f"{src}/{k}" for k in keys]


def _take(ld: ShardedLoader, n: int) -> tuple[list[list[str]], dict]:
    it, got = iter(ld), []
    for _ in range(n):
        got.append(_keys(next(it)))
    it.close()
    return got, json.loads(json.dumps(ld.state_dict()))


@CONFIGS
def test_a_mixture_of_one_source_serves_its_steps_with_metrics_on(sources, config):
    ld = _loader(sources, {"lib": 1.0}, steps=12, **config)
    batches = [b for b in ld]
    assert len(batches) == 12 and all(k.startswith("lib/") for b in batches for k in _keys(b))
    m = ld.metrics()["cumulative"]
    assert m["batches"] == 12 and m["tokens"] > 0 and m["tokens_by_source"] == {"lib": m["tokens"]}
    ld.close()


@CONFIGS
def test_a_mixture_resumed_with_a_source_removed_continues_the_kept_one_and_warns(sources, config, caplog):
    ld = _loader(sources, {"lib": 0.5, "more": 0.5}, **config)
    before, state = _take(ld, 8)
    ld.close()
    served = {k for b in before for k in b}
    resumed = _loader(sources, {"lib": 1.0}, **config)
    with caplog.at_level(logging.INFO, logger="shardtool"):
        resumed.load_state_dict(state)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # A line per change: the source removed, and the weights that changed with it.
    assert len(warned) == 2 and "source 'more' removed" in warned[0] and "step 8" in warned[0], warned
    assert "weights {'lib': 0.5, 'more': 0.5} -> {'lib': 1.0}" in warned[1]
    after = [_keys(b) for b in resumed]  # metrics on: the one source's counters
    assert len(after) == 32 and resumed.metrics()["cumulative"]["batches"] == 32
    assert all(k.startswith("lib/") for b in after for k in b)
    if config is BUCKETED:  # whole samples: nothing served before comes again in the source's first pass
        assert not {k for b in after for k in b} & served
    resumed.close()


def test_sources_added_or_reweighted_are_warned_and_a_new_layout_alone_is_not(sources, caplog):
    ld = _loader(sources, {"lib": 0.7, "more": 0.3}, **BUCKETED)
    _, state = _take(ld, 5)
    ld.close()

    def warnings_resuming(weights: dict, **kw) -> list[str]:
        caplog.clear()
        target = _loader(sources, weights, **BUCKETED, **kw)
        with caplog.at_level(logging.INFO, logger="shardtool"):
            target.load_state_dict(state)
        target.close()
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]

    assert warnings_resuming({"lib": 0.5, "more": 0.5}) == [
        "mixture resumed at step 5 with what it trains on changed: weights {'lib': 0.7, 'more': 0.3} -> "
        "{'lib': 0.5, 'more': 0.5}"
    ]
    removed, _ = warnings_resuming({"lib": 1.0})
    assert "source 'more' removed" in removed
    assert warnings_resuming({"lib": 0.7, "more": 0.3}, world_size=2, ranks_per_node=1) == []


def test_source_changes_names_what_a_resume_changed(sources):
    def phase(weights):
        ld = _loader(sources, weights, **BUCKETED)
        st = MixtureState.from_dict(ld.state_dict())
        ld.close()
        return st.phase

    one, both = phase({"lib": 1.0}), phase({"lib": 0.5, "more": 0.5})
    assert source_changes(one, one) == []
    assert source_changes(one, both)[0] == "source 'more' added (from its beginning)"
    assert source_changes(both, one)[0] == "source 'more' removed (no more of its data is served)"


@pytest.mark.timeout(180)
@CONFIGS
def test_closing_a_mixture_mid_pass_frees_its_workers_shared_memory_and_shards(sources, config):
    before = resources()
    ld = _loader(sources, {"lib": 0.5, "more": 0.5}, num_workers=2, **config)
    it = iter(ld)
    for _ in range(3):
        next(it)
    assert resources() != before  # workers running, the compressed source's shards held in memory
    ld.close()
    assert settled(before) == before  # /dev/shm entries, open descriptors, child processes
    held = ld.readers["more"].ctx.inflated
    assert held is not None and not held.copies  # it held some: the pass read them in place


def test_a_replaced_source_is_refused_unless_the_mixture_says_replace(sources, tmp_path, caplog):
    """A source whose dataset changed under its name (a filtered version, say) cannot continue a
    position in the old one's plan: refused, naming it and the way out; with ``replace`` it
    starts from its beginning, said in a warning of its own, while the other source continues."""
    ld = _loader(sources, {"lib": 0.5, "more": 0.5}, **BUCKETED)
    before, state = _take(ld, 6)
    ld.close()
    # "more" now reads another dataset: "lib"'s files packed again with another shard size.
    paths = stdlib_files(600)[:150]
    other = str(tmp_path / "filtered")
    rows = [{"tokens": byte_ids(p), "path": os.path.relpath(p)} for p in paths]
    shardtool.pack(rows, other, format="arrow", length="tokens", shard_size=1_000_000)
    moved = {**sources, "more": other}
    refused = _loader(moved, {"lib": 0.5, "more": 0.5}, **BUCKETED)
    with pytest.raises(Exception, match=r"source 'more' is another dataset.*replace: \['more'\]"):
        refused.load_state_dict(state)
    refused.close()
    mix = Mixture({"lib": (sources["lib"], 0.5), "more": (other, 0.5)}, replace=["more"])
    resumed = ShardedLoader(mix, steps=40, num_workers=0, seed=3, world_size=1, rank=0, **BUCKETED)
    with caplog.at_level(logging.INFO, logger="shardtool"):
        resumed.load_state_dict(state)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "source 'more' replaced by another dataset" in warned[0], warned
    after = [_keys(b) for b in resumed]
    resumed.close()
    lib_before = {k for b in before for k in b if k.startswith("lib/")}
    assert not {k for b in after for k in b if k.startswith("lib/")} & lib_before  # lib continues
    # "more" from its beginning: its first units are those a fresh run of this mixture serves first.
    fresh = ShardedLoader(mix, steps=40, num_workers=0, seed=3, world_size=1, rank=0, **BUCKETED)
    first_more = [k for b in fresh for k in _keys(b) if k.startswith("more/")]
    got_more = [k for b in after for k in b if k.startswith("more/")]
    assert got_more and got_more == first_more[: len(got_more)]
    fresh.close()
    # A later resume of the replaced run (same versions now) continues it: replace is a no-op there.
    again = ShardedLoader(mix, steps=40, num_workers=0, seed=3, world_size=1, rank=0, **BUCKETED)
    mid = ShardedLoader(mix, steps=40, num_workers=0, seed=3, world_size=1, rank=0, **BUCKETED)
    mid.load_state_dict(state)
    _, later = _take(mid, 5)
    mid.close()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="shardtool"):
        again.load_state_dict(later)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [_keys(b) for b in again] == after[5:]
    again.close()


def test_a_mixture_file_says_replace():
    mix = Mixture.from_dict({"sources": {"a": {"url": "/x", "weight": 1}}, "replace": ["a"]})
    assert mix.replace == {"a"} and Mixture.from_dict(mix.to_dict()).replace == {"a"}
    with pytest.raises(ValueError, match="replace names sources this mixture does not have"):
        Mixture.from_dict({"sources": {"a": {"url": "/x", "weight": 1}}, "replace": ["b"]})
