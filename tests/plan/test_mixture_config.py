"""A mixture's configuration: sources, token weights, schedule, max_repeat; the file forms."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
import yaml

from shardtool.plan import Batching
from shardtool.plan.mixture import Mixture, MixtureError, MixtureSource, is_mixture_file, source_batching, source_seed
from shardtool.plan.packing import Packing


def test_weights_are_exact_fractions_and_the_schedule_starts_with_them():
    m = Mixture(
        {"web": ("s3://b/web", 0.6), "code": ("/lustre/code", "0.3"), "math": ("/m", Fraction(1, 10))},
        schedule=[(500, {"web": 1, "code": 0, "math": 1})],
    )
    assert m.names == ("web", "code", "math")
    assert m.schedule == (
        (0, (Fraction(3, 5), Fraction(3, 10), Fraction(1, 10))),
        (500, (Fraction(1), Fraction(0), Fraction(1))),
    )
    assert m.schedule_identity() == [
        [0, {"web": "3/5", "code": "3/10", "math": "1/10"}],
        [500, {"web": "1", "code": "0", "math": "1"}],
    ]


@pytest.mark.parametrize(
    "sources, schedule, match",
    [
        ({"web": ("/w", -1)}, None, "must be >= 0"),
        ({"web": ("/w", float("nan"))}, None, "finite"),
        ({"web": ("/w", True)}, None, "must be a number"),
        ({"web": ("/w", 0)}, None, "at least one weight must be > 0"),
        ({"we b": ("/w", 1)}, None, "source name"),
        ({"../x": ("/w", 1)}, None, "source name"),
        ({"web": ("", 1)}, None, "non-empty"),
        ({"web": ("/w", 1)}, [(10, {"Web": 1})], r"unknown \['Web'\], missing \['web'\]"),
        ({"web": ("/w", 1)}, [(0, {"web": 1})], "from_step must be an int >= 1"),
        ({"web": ("/w", 1)}, [(10, {"web": 1}), (5, {"web": 2})], "increasing"),
        ({"web": ("/w", 1)}, [(10, {"web": 0})], "step 10: at least one weight"),
    ],
)
def test_bad_mixtures_are_refused_naming_what_is_wrong(sources, schedule, match):
    with pytest.raises(MixtureError, match=match):
        Mixture(sources, schedule)


def test_duplicate_names_and_bad_max_repeat_are_refused():
    with pytest.raises(MixtureError, match="unique"):
        Mixture([MixtureSource("a", "/a", 1), MixtureSource("a", "/b", 1)])
    with pytest.raises(MixtureError, match="max_repeat"):
        Mixture({"a": ("/a", 1)}, max_repeat=0)


def test_json_and_yaml_files_with_paths_relative_to_the_file(tmp_path):
    body = {
        "sources": {"web": {"url": "web", "weight": 0.7}, "code": ["../code", 0.3]},
        "schedule": [{"from_step": 100, "weights": {"web": 0.5, "code": 0.5}}, [200, {"web": 1, "code": 0}]],
        "max_repeat": 3,
    }
    (tmp_path / "mix.json").write_text(json.dumps(body))
    m = Mixture.from_file(str(tmp_path / "mix.json"))
    assert [s.url for s in m.sources] == [str(tmp_path / "web"), str(tmp_path.parent / "code")]
    assert m.max_repeat == 3 and [s for s, _ in m.schedule] == [0, 100, 200]
    assert Mixture.from_dict(m.to_dict()).schedule_identity() == m.schedule_identity()
    (tmp_path / "mix.yaml").write_text(yaml.safe_dump(body, sort_keys=False))
    assert Mixture.from_file(str(tmp_path / "mix.yaml")).fingerprint() == m.fingerprint()
    assert is_mixture_file(str(tmp_path / "mix.json")) and not is_mixture_file(str(tmp_path))


def test_a_bad_file_is_refused_with_its_path(tmp_path):
    bad = tmp_path / "mix.json"
    bad.write_text("{not json")
    with pytest.raises(MixtureError, match="mix.json: not valid JSON"):
        Mixture.from_file(str(bad))
    bad.write_text(json.dumps({"sources": {"web": {"url": "/w", "weigth": 1}}}))
    with pytest.raises(MixtureError, match="mix.json: source 'web': expected keys url and weight"):
        Mixture.from_file(str(bad))
    with pytest.raises(MixtureError, match="cannot read mixture file"):
        Mixture.from_file(str(tmp_path / "missing.json"))


def test_with_weights_replaces_the_schedule_for_the_rest_of_a_run():
    m = Mixture({"web": ("/w", 1), "code": ("/c", 1)}, schedule=[(10, {"web": 0, "code": 1})])
    new = m.with_weights({"web": 0.25, "code": 0.75})
    assert new.schedule == ((0, (Fraction(1, 4), Fraction(3, 4))),)
    with pytest.raises(MixtureError, match="missing"):
        m.with_weights({"web": 1})


def test_source_seeds_are_stable_and_distinct():
    # A fixed value: a seed that changed between releases would reshuffle every source on resume.
    assert source_seed(0, "web") == 2177310492056704960 != source_seed(0, "code")
    assert source_seed(0, "web") != source_seed(1, "web")
    assert 0 <= source_seed(2**31, "x" * 64) < 2**63
    packed = source_batching(Batching(batch_size=8, seed=3, packing=Packing(128)), "web")
    assert packed.batch_size == 1 and packed.seed == source_seed(3, "web")  # a unit is one row
    assert source_batching(Batching(max_tokens=512), "web").max_tokens == 512


def test_a_mixture_file_may_say_how_the_run_batches_it():
    """issue 36: a ramp and a warmup declared in the mixture file, as the loader's keywords."""
    data = {
        "sources": {"web": {"url": "/w", "weight": 1}},
        "batch_size": {"0": 4, "2000": 8},
        "seq_len": {"0": 2048},
    }
    m = Mixture.from_dict(json.loads(json.dumps(data)))
    assert m.batching == {"batch_size": {0: 4, 2000: 8}, "seq_len": 2048}  # a one-value schedule is that value
    again = Mixture.from_dict(json.loads(json.dumps(m.to_dict())))
    assert again.batching == m.batching and again.fingerprint() == Mixture({"web": ("/w", 1)}).fingerprint()
    assert m.with_weights({"web": 2}).batching == m.batching
    # What the loader was not given comes from the file; what both give must agree.
    assert m.batching_args(batch_size=None, seq_len=None, max_tokens=None) == {
        "batch_size": {0: 4, 2000: 8},
        "seq_len": 2048,
        "max_tokens": None,
    }
    assert m.batching_args(batch_size={2000: 8, 0: 4}, seq_len=2048, max_tokens=None)["batch_size"] == {2000: 8, 0: 4}
    with pytest.raises(MixtureError, match="batch_size=8 differs from the mixture's batch_size"):
        m.batching_args(batch_size=8, seq_len=None, max_tokens=None)
    with pytest.raises(MixtureError, match="max_tokens=4096 given, and the mixture's batch_size"):
        m.batching_args(batch_size=None, seq_len=None, max_tokens=4096)
    assert Mixture({"web": ("/w", 1)}).batching_args(batch_size=8, seq_len=None) == {"batch_size": 8, "seq_len": None}


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("batch_size", 0, "batch_size must be an int >= 1"),
        ("batch_size", "8", "batch_size must be an int >= 1"),
        ("seq_len", {"100": 2048}, "must say the size from step 0"),
        ("seq_len", {"0": -1}, "seq_len schedule maps"),
        ("max_tokens", {"0": 4096}, "max_tokens by step is not supported for a mixture"),
        ("micro_batches", 2, "unknown mixture keys"),
    ],
)
def test_a_mixture_files_batching_is_checked_naming_the_key(key, value, match):
    with pytest.raises(MixtureError, match=match):
        Mixture.from_dict({"sources": {"web": {"url": "/w", "weight": 1}}, key: value})
