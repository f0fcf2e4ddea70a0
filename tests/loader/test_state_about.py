"""A refused loader state names what it was saved for: dataset URL and version, batching settings.

Fingerprints alone (`found dataset fingerprint 'xxh3_128:d78c…'`) leave the user to guess which
dataset or which setting differs. States from before the description still load.
"""

from __future__ import annotations

import json
import re

import pytest

from shardtool.format import open_dataset
from shardtool.loader import LoaderStateError, ShardedLoader
from shardtool.plan.mixture import Mixture
from test_loader_data import read_all, write_dataset


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    base = tmp_path_factory.mktemp("about")
    a, _ = write_dataset(str(base / "a"), [20, 13])
    b, _ = write_dataset(str(base / "b"), [20, 13], seed=9)
    return a, b


def _saved_mid_epoch(url, **kw) -> dict:
    ld = ShardedLoader(url, num_workers=0, **kw)
    it = iter(ld)
    next(it)
    return json.loads(json.dumps(ld.state_dict()))  # as a checkpoint holds it


def test_another_dataset_is_named_by_url_and_version(two):
    a, b = two
    state = _saved_mid_epoch(a, batch_size=4)
    va, vb = open_dataset(a).version, open_dataset(b).version
    with pytest.raises(LoaderStateError) as e:
        ShardedLoader(b, batch_size=4, num_workers=0).load_state_dict(state)
    msg = str(e.value)
    expected = f"found dataset '{a}' (version '{va}', 33 samples), expected dataset '{b}' (version '{vb}', 33 samples)"
    assert expected in msg, msg


def test_another_batching_is_named_by_its_settings(two):
    a, _ = two
    state = _saved_mid_epoch(a, batch_size=4)
    with pytest.raises(LoaderStateError) as e:
        ShardedLoader(a, max_tokens=256, seed=3, num_workers=0).load_state_dict(state)
    msg = str(e.value)
    assert (
        "found batching {batch_size: 4, shuffle: true, seed: 0, bucketing: true}, expected "
        "{max_tokens: 256, shuffle: true, seed: 3, bucketing: true} (differing: batch_size, max_tokens, seed)" in msg
    ), msg
    assert "fingerprint" not in msg


def test_the_state_stays_small_json_and_identical_on_every_rank(two):
    a, _ = two
    states = []
    for rank in (0, 1):
        ld = ShardedLoader(a, batch_size=4, rank=rank, world_size=2, ranks_per_node=1, num_workers=0)
        next(iter(ld))
        states.append(ld.state_dict())
    assert states[0] == states[1]
    assert states[0]["about"]["dataset"] == {"url": a, "version": open_dataset(a).version, "samples": 33}
    assert len(json.dumps(states[0])) < 700


def test_a_state_from_before_the_description_still_loads_and_a_refusal_says_it_names_nothing(two):
    a, b = two
    state = _saved_mid_epoch(a, batch_size=4)
    old = {k: v for k, v in state.items() if k != "about"}  # as the previous release saved it
    fresh = ShardedLoader(a, batch_size=4, num_workers=0)
    fresh.load_state_dict(old)
    again = ShardedLoader(a, batch_size=4, num_workers=0)
    again.load_state_dict(state)
    assert read_all(fresh) == read_all(again)
    assert fresh.state_dict()["about"]["dataset"]["url"] == a  # saved again, it names its dataset
    with pytest.raises(
        LoaderStateError,
        match=r"found dataset fingerprint '[^']+' \(a state saved before shardtool "
        r"described what it was saved for: it names no URL\), expected dataset " + re.escape(f"'{b}'"),
    ):
        ShardedLoader(b, batch_size=4, num_workers=0).load_state_dict(old)
    with pytest.raises(
        LoaderStateError,
        match=r"found batching fingerprint '\w+' \(.*names no settings\), "
        r"expected \{batch_size: 5,",
    ):
        ShardedLoader(a, batch_size=5, num_workers=0).load_state_dict(old)


def test_a_mixture_state_names_the_batching_and_the_url_it_was_saved_on(two, tmp_path):
    a, b = two
    ld = ShardedLoader(Mixture({"x": (a, 0.5), "y": (b, 0.5)}), steps=6, max_tokens=160, num_workers=0)
    next(iter(ld))
    state = json.loads(json.dumps(ld.state_dict()))
    assert state["about"]["sources"] == {"x": a, "y": b}
    other = ShardedLoader(Mixture({"x": (a, 0.5), "y": (b, 0.5)}), steps=6, max_tokens=320, num_workers=0)
    with pytest.raises(
        LoaderStateError,
        match=r"found batching \{max_tokens: 160, .*\}, expected \{max_tokens: 320, "
        r".*\(differing: max_tokens\)",
    ):
        other.load_state_dict(state)
    c, _ = write_dataset(str(tmp_path / "c"), [20, 13], seed=4)
    moved = ShardedLoader(Mixture({"x": (a, 0.5), "y": (c, 0.5)}), steps=6, max_tokens=160, num_workers=0)
    with pytest.raises(LoaderStateError) as e:
        moved.load_state_dict(state)
    assert f"at '{c}', expected '{open_dataset(b).version}' (the state's, saved on '{b}')" in str(e.value)
