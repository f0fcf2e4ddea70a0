"""ShardedLoader(Mixture(...), cost_model=...) on real text (issue 33): every rank's steps cost what
the plan says (`shardtool.plan.mixture.cost.step_costs`) and less unevenly than without the cost
model; a resume continues them exactly, an elastic one repeats nothing; `shardtool stats` reads
the balance back from the metric files. Two sources of other shapes: long stdlib files and short
/usr/share/doc ones, as byte ids, rows of 1,024."""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers.cutrun import served_then_saved
from helpers.packedpieces import piece_lengths
from helpers.realtext import long_and_short_mixture
from shardtool.loader import LoaderStateError, ShardedLoader
from shardtool.plan.cost import CostModel, step_balance
from shardtool.plan.mixture.cost import step_costs

MODEL = CostModel.parse("llama-7b")
SEQ, ROWS, STEPS = 1024, 2, 30


@pytest.fixture(scope="module")
def mix(tmp_path_factory):
    return long_and_short_mixture(str(tmp_path_factory.mktemp("mixbal")), (120, 20), (20, 150), (0.7, 0.3), least=80)


def _ranks(mix, world, cost_model=MODEL, **kw):
    kw = {"seq_len": SEQ, "batch_size": ROWS, "eos_id": 256, "seed": 2, "num_workers": 0, "steps": STEPS, **kw}
    return [
        ShardedLoader(mix, rank=r, world_size=world, ranks_per_node=world, cost_model=cost_model, **kw)
        for r in range(world)
    ]


def _step(b) -> list:
    """A served step: its tokens (its rows', padding too), then (source, key, offset, length) of
    each piece."""
    sources = [s for s, keys in zip(b["__source__"], b["__key__"]) for _ in keys]
    return [b["input_ids"].numel(), *[(s, *p) for s, p in zip(sources, piece_lengths(b))]]


def _served(loaders) -> list[list[list]]:
    """Per rank, per step: `_step` of what it served."""
    out = []
    for ld in loaders:
        out.append([_step(b) for b in ld])
        ld.close()
    return out


def _costs(served) -> np.ndarray:
    """What each step costs under the model, from what was served."""
    cost = lambda step: MODEL.a * step[0] + MODEL.b * sum(p[-1] ** 2 for p in step[1:])  # noqa: E731
    return np.array([[cost(step) for step in rank] for rank in served], np.float64)


def _no_token_twice(served) -> None:
    """Across ranks and steps: no (source, document) piece overlaps another."""
    spans: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for rank in served:
        for step in rank:
            for source, key, off, n in step[1:]:
                spans.setdefault((source, key), []).append((off, off + n))
    for doc, parts in spans.items():
        parts.sort()
        assert all(a[1] <= b[0] for a, b in zip(parts, parts[1:])), doc


@pytest.mark.timeout(300)
def test_each_ranks_steps_cost_what_the_plan_says_and_are_more_even(mix):
    world = 4
    loaders = _ranks(mix, world)
    src = loaders[0].batch_source
    planned = step_costs(src.planner, src.state, range(world), range(STEPS), MODEL)
    served = _served(loaders)
    assert np.allclose(_costs(served), planned, rtol=1e-12)
    _no_token_twice(served)
    plain = _costs(_served(_ranks(mix, world, cost_model=None)))
    assert step_balance(_costs(served))["time_lost"] < step_balance(plain)["time_lost"] / 2


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cut,new_world", [(7, 2), (11, 3)])
def test_a_balanced_mixture_resumes_exactly_and_elastically(mix, cut, new_world):
    whole = _served(_ranks(mix, 2))
    first = _ranks(mix, 2, num_workers=2)
    done, states = served_then_saved(first, cut, _step)
    assert states[0] == states[1]
    assert done == [w[:cut] for w in whole]  # 2 workers serve what 0 did
    resumed = _ranks(mix, new_world)
    for ld in resumed:
        ld.load_state_dict(json.loads(json.dumps(states[0])))
    src = resumed[0].batch_source
    planned = step_costs(src.planner, src.state, range(new_world), range(cut, STEPS), MODEL)
    rest = _served(resumed)
    assert np.allclose(_costs(rest), planned, rtol=1e-12)
    if new_world == 2:
        assert rest == [w[cut:] for w in whole]  # the uninterrupted run's steps, rank by rank
    else:
        _no_token_twice(done + rest)


@pytest.mark.timeout(300)
def test_a_balanced_mixtures_warmup_steps_cost_what_the_plan_says_cut(mix):
    """Rows planned at 1,024 and balanced by their cost, served cut to 256 for the warmup's steps:
    each step costs what `step_costs` says of its rows as cut, and the cut steps stay even."""
    world, warm = 4, dict(seq_len={0: 256, 10: 1024}, batch_size=8)
    loaders = _ranks(mix, world, **warm)
    src = loaders[0].batch_source
    planned = step_costs(src.planner, src.state, range(world), range(STEPS), MODEL, seq_len_at=src.schedule.seq_len_at)
    served = _costs(_served(loaders))
    assert np.allclose(served, planned, rtol=1e-12)
    plain = _costs(_served(_ranks(mix, world, cost_model=None, **warm)))
    # Rows of 256 hold pieces of at most 256 tokens: their steps are even either way (0.004% lost
    # without the cost model), and stay so; rows of 1,024 lose less than half of what they did.
    assert step_balance(served[:, :10])["time_lost"] < 0.001
    assert step_balance(served[:, 10:])["time_lost"] < step_balance(plain[:, 10:])["time_lost"] / 2


@pytest.mark.timeout(300)
def test_a_bucketed_mixtures_steps_cost_what_the_plan_says(mix):
    """One batch of one source a step, priced padded to its longest sample, as the plan prices it."""
    world, kw = 3, dict(max_tokens=1 << 18, seq_len=None, batch_size=None)

    def served(loaders) -> np.ndarray:
        out = []
        for ld in loaders:
            mine = []
            for b in ld:
                m, longest = len(b["lengths"]), max(int(b["lengths"].max()), 1)
                mine.append(m * (MODEL.a * longest + MODEL.b * longest**2))
            out.append(mine)
            ld.close()
        return np.array(out, np.float64)

    loaders = _ranks(mix, world, **kw)
    src = loaders[0].batch_source
    planned = step_costs(src.planner, src.state, range(world), range(STEPS), MODEL)
    balanced = served(loaders)
    assert np.allclose(balanced, planned, rtol=1e-12)
    plain = served(_ranks(mix, world, cost_model=None, **kw))
    # A few batches a rank per source-epoch here, one of them a 200k-token document: what the
    # ranks' shares hold bounds it (tests/plan/test_mixture_balance.py measures it at scale).
    assert step_balance(balanced)["time_lost"] < step_balance(plain)["time_lost"]


def test_a_state_of_a_balanced_mixture_is_refused_by_a_plain_one(mix):
    (balanced,) = _ranks(mix, 1)
    (plain,) = _ranks(mix, 1, cost_model=None)
    with pytest.raises(LoaderStateError, match="balance"):
        plain.load_state_dict(balanced.state_dict())


@pytest.mark.timeout(300)
def test_shardtool_stats_reads_a_mixtures_step_balance_from_its_metric_files(mix, tmp_path, capsys):
    from shardtool.cli import main

    world, every = 3, 4
    loaders = _ranks(mix, world, metrics_dir=str(tmp_path / "m"), metrics_every=every)
    costs = _costs(_served(loaders))
    assert STEPS % every, "the run ends between metric lines"
    assert main(["stats", str(tmp_path / "m"), "--json", "-"]) == 0
    got = json.loads(capsys.readouterr().out)["balance"]
    # Every step, those after the last periodic line too: the run's end writes a line for them.
    assert got["plan_cost"] == pytest.approx(step_balance(costs))


def test_shardtool_plan_reports_a_mixtures_step_balance_with_and_without(mix, tmp_path):
    from helpers.runcli import shardtool_cli

    path = tmp_path / "mix.json"
    path.write_text(json.dumps({"sources": {s.name: {"url": s.url, "weight": float(s.weight)} for s in mix.sources}}))
    args = ["plan", str(path), "--seq-len", str(SEQ), "--batch-size", str(ROWS), "--steps", str(STEPS)]
    args += ["--eos-id", "256", "--seed", "2", "--ranks-per-node", "4", "--cost-model", "llama-7b"]
    res = shardtool_cli(*args, "--json")
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)["compute_balance"]
    loaders = _ranks(mix, 4)
    src = loaders[0].batch_source
    want = step_balance(step_costs(src.planner, src.state, range(4), range(STEPS), MODEL))
    assert got["balanced"] == pytest.approx(want) and got["steps_compared"] == STEPS
    assert got["unbalanced"]["time_lost"] > 2 * got["balanced"]["time_lost"]
    text = shardtool_cli(*args).stdout
    assert f"over the first {STEPS} steps" in text and "balanced:    per-step max/mean cost over 4 DP ranks" in text
    refused = shardtool_cli(*args[:-2], "--balance-window", "4")
    assert refused.returncode != 0 and "give --cost-model too" in refused.stderr


@pytest.mark.timeout(300)
def test_shardtool_plans_report_goes_past_a_small_sources_first_epoch_as_the_run_does(mix, tmp_path):
    """The short documents' source ends its first epoch at step ~300 of a run of 600: the report
    prices all 600 steps (later epochs are planned again, within its budget), and its figures,
    with and without the cost model, are those of what the ranks serve over them."""
    from helpers.runcli import shardtool_cli
    from shardtool.plan.mixture.cost import first_epoch_steps, report_steps

    steps, world = 600, 4
    balanced = _ranks(mix, world, steps=steps)
    src = balanced[0].batch_source
    assert first_epoch_steps(src.planner, src.state, steps) < steps // 2
    assert report_steps(src.planner, src.state, steps, 1.0) == first_epoch_steps(src.planner, src.state, steps)
    assert report_steps(src.planner, src.state, 10 * steps, 3.0) < 10 * steps  # the budget ends a long report
    path = tmp_path / "mix.json"
    path.write_text(json.dumps({"sources": {s.name: {"url": s.url, "weight": float(s.weight)} for s in mix.sources}}))
    args = ["plan", str(path), "--seq-len", str(SEQ), "--batch-size", str(ROWS), "--steps", str(steps)]
    args += ["--eos-id", "256", "--seed", "2", "--ranks-per-node", str(world), "--cost-model", "llama-7b"]
    res = shardtool_cli(*args, "--json")
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)["compute_balance"]
    assert got["steps_compared"] == steps
    served = {
        "balanced": _costs(_served(balanced)),
        "unbalanced": _costs(_served(_ranks(mix, world, None, steps=steps))),
    }
    for side, costs in served.items():
        assert got[side] == pytest.approx(step_balance(costs)), side
    assert got["unbalanced"]["time_lost"] > 2 * got["balanced"]["time_lost"]


@pytest.mark.timeout(400)
def test_torchrun_balanced_mixture_ramp_resumed_after_a_kill_matches_the_uninterrupted_run(mix, tmp_path):
    """2 ranks under torchrun (gloo, a collective every step), rows ramping 4 -> 8 at step 10, the
    steps balanced by a cost model; rank 1 killed with SIGKILL at step 8: resumed from rank 0's
    last state, every rank serves the steps the uninterrupted run served."""
    from helpers.schedrun import killed_and_resumed

    path = tmp_path / "mix.json"
    path.write_text(json.dumps({"sources": {s.name: [s.url, float(s.weight)] for s in mix.sources}}))
    saved, runs = killed_and_resumed(str(path), str(tmp_path), "--mixture", "--cost-model", "llama-7b")
    assert 1 <= saved["steps"] <= 8
    for whole, resumed in runs:
        start = saved["steps"]
        assert whole["len"] == resumed["len"] == 20 and sorted(map(int, resumed["steps"])) == list(range(start, 20))
        assert all(resumed["steps"][str(s)] == whole["steps"][str(s)] for s in range(start, 20))
        assert [whole["steps"][str(s)][2][0] for s in range(20)] == [4] * 10 + [8] * 10
    # The torchrun run serves the balanced plan (in process, the same loader), not the plain one.
    kw = dict(seq_len=256, batch_size={0: 4, 10: 8}, seed=7, steps=20, token_fields=[], eos_id=None)
    for cost_model, same in ((MODEL, True), (None, False)):
        keys = [[list(map(str, k)) for k in b["__key__"]] for b in _ranks(mix, 2, cost_model=cost_model, **kw)[1]]
        assert (keys == [runs[1][0]["steps"][str(s)][0] for s in range(20)]) is same
