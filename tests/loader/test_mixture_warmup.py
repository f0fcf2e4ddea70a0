"""A packed mixture under a sequence-length warmup (``seq_len={0: 256, 4: 1024}``).

Its rows are planned at the longest length and each step of shorter rows cuts its planned rows, so
the tokens of every step are, in order, those of the same mixture at the longest length taking the
same tokens a step (``batch_size={0: 2, 4: 8}`` rows of 1024). Real text as byte ids: long stdlib
files and short /usr/share/doc ones, two sources of other shapes."""

from __future__ import annotations

import json

import numpy as np
import pytest

import shardtool
from helpers.packedpieces import packed_pieces
from helpers.realtext import long_and_short_mixture
from helpers.runcli import shardtool_cli
from helpers.schedrun import killed_and_resumed
from shardtool.loader import ShardedLoader
from shardtool.loader.trace import find, trace

PAD = 999  # byte ids are < 256
WARMUP = dict(seq_len={0: 256, 4: 1024}, batch_size=8)
SAME_TOKENS = dict(seq_len=1024, batch_size={0: 2, 4: 8})  # the warmup's tokens a step, uncut
STEPS = 12


@pytest.fixture(scope="module")
def mix(tmp_path_factory):
    return long_and_short_mixture(str(tmp_path_factory.mktemp("mixwarm")), (60, 20), (10, 120), (0.6, 0.4), least=50)


def _ranks(mix, world, **kw):
    kw = {"seed": 3, "num_workers": 0, "pad_id": PAD, "token_fields": [], "steps": STEPS, **kw}
    return [ShardedLoader(mix, rank=r, world_size=world, ranks_per_node=world, **kw) for r in range(world)]


def _tokens(batch) -> np.ndarray:
    flat = batch["input_ids"].numpy().ravel()
    return flat[flat != PAD]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,workers", [(1, 0), (2, 2)])
def test_each_step_serves_the_tokens_of_the_uncut_run_in_rows_of_its_length(mix, world, workers):
    warm, same = _ranks(mix, world, num_workers=workers, **WARMUP), _ranks(mix, world, **SAME_TOKENS)
    for a, b in zip(warm, same):
        got = list(a)
        want = list(b)
        assert len(got) == len(want) == STEPS
        for t, (x, y) in enumerate(zip(got, want)):
            assert tuple(x["input_ids"].shape) == (8, 256 if t < 4 else 1024)
            assert np.array_equal(_tokens(x), _tokens(y)), t
            assert [(p["row"], p["key"], p["offset"]) for p in trace(a, t)["samples"]] == packed_pieces(x)
            # Each source's rows stay together, in the uncut run's order and share of the tokens.
            assert x["per_source_tokens"] == y["per_source_tokens"]
            assert sorted(set(x["__source__"]), key=x["__source__"].index) == sorted(
                set(y["__source__"]), key=y["__source__"].index
            )
        a.close()


@pytest.mark.timeout(300)
def test_find_names_the_cut_rows_that_serve_a_sample(mix):
    loaders = _ranks(mix, 2, **WARMUP)
    where: dict[tuple[str, int], set] = {}
    for ld in loaders:
        for t in range(STEPS):
            for u in trace(ld, t)["samples"]:
                entry = (ld.dp_rank, t, u["row"], u["offset"], u["length"])
                where.setdefault((u["source"], u["sample"]), set()).add(entry)
    rng = np.random.default_rng(1)
    keys = sorted(where)
    for source, sample in [keys[i] for i in rng.choice(len(keys), 25, replace=False)]:
        got = [
            (e["dp_rank"], e["step"], e["row"], e["offset"], e["length"])
            for e in find(loaders[0], sample, source=source)
        ]
        assert len(got) == len(set(got)) and set(got) == where[source, sample]
    n = len(shardtool.open_dataset(mix.sources[0].url))
    unserved = sorted(set(range(n)) - {s for (src, s) in where if src == "long"})
    assert unserved and find(loaders[0], unserved[0], source="long") == []  # past the run's steps


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stop", [2, 4, 7])
@pytest.mark.parametrize("world_after", [2, 3])
def test_a_resume_before_at_or_after_the_change_continues_the_run(mix, stop, world_after):
    """States saved at step ``stop`` on 2 ranks resume on ``world_after``: the steps after it serve,
    on every rank together, what a run on that layout from that state serves, and across the
    ranks the tokens of the uncut run's steps (nothing repeated or lost at the change)."""
    first = _ranks(mix, 2, **WARMUP)
    states = []
    for ld in first:
        for _, _ in zip(range(stop), ld):
            pass
        states.append(ld.state_dict())
    assert states[0] == states[1]
    resumed = _ranks(mix, world_after, **WARMUP)
    again = _ranks(mix, world_after, **WARMUP)
    for a, b in zip(resumed, again):
        a.load_state_dict(json.loads(json.dumps(states[0])))
        b.load_state_dict(json.loads(json.dumps(states[0])))
        got, want = list(a), list(b)
        assert len(got) == STEPS - stop
        for t, (x, y) in enumerate(zip(got, want), start=stop):
            assert tuple(x["input_ids"].shape) == (8, 256 if t < 4 else 1024)
            assert np.array_equal(x["input_ids"].numpy(), y["input_ids"].numpy())
    # The same resume under the uncut run's rows by step serves the same tokens step by step.
    uncut = _ranks(mix, world_after, **SAME_TOKENS)
    for a, b in zip(_ranks(mix, world_after, **WARMUP), uncut):
        a.load_state_dict(states[0])
        b.load_state_dict(states[0])
        for x, y in zip(a, b):
            assert np.array_equal(_tokens(x), _tokens(y))


def test_shardtool_plan_shows_the_warmups_rows(mix, tmp_path):
    path = tmp_path / "mix.json"
    path.write_text(json.dumps({"sources": {s.name: {"url": s.url, "weight": float(s.weight)} for s in mix.sources}}))
    res = shardtool_cli("plan", str(path), "--seq-len", "0:256,4:1024", "--batch-size", "8", "--steps", "12", "--json")
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    assert got["seq_len_by_step"] == [[0, 8, 256], [4, 8, 1024]] and got["rows_by_step"] == [[0, 2], [4, 8]]
    text = shardtool_cli("plan", str(path), "--seq-len", "0:256,4:1024", "--batch-size", "8", "--steps", "12")
    assert "12 steps of 8 rows of 256 tokens (8 of 1024 from step 4; cut from rows of 1024)" in text.stdout, text.stdout


@pytest.mark.timeout(400)
def test_torchrun_warmup_resumed_after_a_kill_matches_the_uninterrupted_run(mix, tmp_path):
    """2 ranks under torchrun (gloo, a collective every step), rank 1 killed with SIGKILL at step 8,
    before the change at 10: resumed from rank 0's last state, every rank serves the steps the
    uninterrupted run served, rows of 256 and then of 512, the change on every rank at once."""
    path = tmp_path / "mix.json"
    path.write_text(json.dumps({"sources": {s.name: [s.url, float(s.weight)] for s in mix.sources}}))
    saved, runs = killed_and_resumed(str(path), str(tmp_path), "--mixture", "--warmup")
    assert 1 <= saved["steps"] <= 8
    for whole, resumed in runs:
        start = saved["steps"]
        assert whole["len"] == resumed["len"] == 20 and sorted(map(int, resumed["steps"])) == list(range(start, 20))
        assert all(resumed["steps"][str(s)] == whole["steps"][str(s)] for s in range(start, 20))
        assert [whole["steps"][str(s)][2] for s in range(20)] == [[4, 256]] * 10 + [[4, 512]] * 10
