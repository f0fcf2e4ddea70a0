"""ShardedLoader(cost_model=...) on real text (stdlib files as byte ids, seq_len 1,024): each
rank serves its plan's balanced batches, so the steps the ranks train on cost what the plan says
(and less unevenly than without a cost model); resume continues them exactly, on another number
of ranks too; a state of one configuration is refused by the other."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import shardtool
from helpers.cutrun import served_then_saved
from helpers.packedpieces import piece_lengths
from helpers.realtext import byte_ids, stdlib_files
from shardtool.loader import LoaderStateError, ShardedLoader
from shardtool.plan import DataLayout, Layout
from shardtool.plan.cost import CostModel, step_balance
from shardtool.plan.simulate import simulate_epoch

EOS = 256
SEQ = 1024
MODEL = CostModel.parse("llama-7b")


@pytest.fixture(scope="module")
def stdlib_root(tmp_path_factory):
    rows = [{"tokens": byte_ids(p), "path": os.path.relpath(p)} for p in stdlib_files(300)]
    root = str(tmp_path_factory.mktemp("balanced") / "d")
    shardtool.pack(rows, root, format="arrow", length="tokens", shard_size=2_000_000)
    return root


def _loaders(root: str, world: int, cost_model=MODEL, **kw) -> list[ShardedLoader]:
    kw = {"seq_len": SEQ, "batch_size": 2, "eos_id": EOS, "seed": 4, "num_workers": 0, "cost_model": cost_model, **kw}
    return [ShardedLoader(root, rank=r, world_size=world, ranks_per_node=world, **kw) for r in range(world)]


def _epoch(loaders) -> list[list[list[tuple]]]:
    """Per rank, per step: the pieces of the batch it served."""
    return [[piece_lengths(b) for b in ld] for ld in loaders]


def _served_tokens(served) -> dict[str, int]:
    """Per document: the tokens served, checked to tile it from its start (pieces head first)."""
    by_key: dict[str, list[tuple[int, int]]] = {}
    for rank in served:
        for b in rank:
            for key, off, n in b:
                by_key.setdefault(key, []).append((off, n))
    out = {}
    for key, parts in by_key.items():
        at = 0
        for off, n in sorted(parts):
            assert off == at, f"{key}: a piece at {off} where {at} was expected"
            at += n
        out[key] = at
    return out


def _costs(served) -> np.ndarray:
    """[ranks, steps]: each served batch's cost, from the pieces it carried (2 rows of SEQ tokens)."""
    return np.array(
        [[MODEL.a * 2 * SEQ + MODEL.b * sum(n * n for _, _, n in b) for b in rank] for rank in served], np.float64
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 4])
def test_the_steps_served_cost_what_the_plan_says_and_are_more_even(stdlib_root, world):
    loaders = _loaders(stdlib_root, world)
    served = _epoch(loaders)
    sim = simulate_epoch(
        shardtool.open_dataset(stdlib_root),
        DataLayout.pure_dp(Layout(1, world)),
        loaders[0].batching,
        cost_model=MODEL,
    )
    assert np.allclose(_costs(served), sim.step_costs, rtol=1e-12)
    plain = _epoch(_loaders(stdlib_root, world, cost_model=None))
    assert _served_tokens(served) == _served_tokens(plain), "the same tokens of every document, dealt otherwise"
    if world > 1:
        assert step_balance(_costs(served))["time_lost"] < step_balance(_costs(plain))["time_lost"] / 2


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cut", [0, 5, 17])
@pytest.mark.parametrize("new_world", [2, 3])
def test_a_balanced_run_resumes_exactly_and_elastically(stdlib_root, cut, new_world):
    every = {"drop_last": False}  # every token served: an epoch's tokens are comparable across layouts
    whole = _epoch(_loaders(stdlib_root, 2, **every))
    first = _loaders(stdlib_root, 2, num_workers=2, **every)
    done, states = served_then_saved(first, cut, piece_lengths)
    assert done == [w[:cut] for w in whole] and all(s == states[0] for s in states)
    resumed = _loaders(stdlib_root, new_world, **every)
    for ld in resumed:
        ld.load_state_dict(states[0])
    leftover = resumed[0].plan.leftover_batches  # whole batches the re-deal over 3 ranks leaves out
    rest = _epoch(resumed)
    if new_world == 2:
        assert rest == [w[cut:] for w in whole]  # the uninterrupted run's batches, rank by rank
        return
    got, want = _served_tokens(done + rest), _served_tokens(whole)  # no token twice, no gap
    short = {k: want[k] - got.get(k, 0) for k in want if got.get(k, 0) != want[k]}
    assert all(v > 0 for v in short.values()) and sum(short.values()) <= leftover * 2 * SEQ


def test_a_state_of_a_balanced_loader_is_refused_by_a_plain_one_and_back(stdlib_root):
    # Inside an epoch (at an epoch's start the epoch is planned anew: see the calibrated test).
    (balanced,) = _loaders(stdlib_root, 1)
    (plain,) = _loaders(stdlib_root, 1, cost_model=None)
    next(iter(balanced))
    next(iter(plain))
    with pytest.raises(LoaderStateError, match="balance"):
        _loaders(stdlib_root, 1, cost_model=None)[0].load_state_dict(balanced.state_dict())
    with pytest.raises(LoaderStateError, match="batching"):
        _loaders(stdlib_root, 1)[0].load_state_dict(plain.state_dict())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("micro", [1, 2])
def test_shardtool_stats_reads_the_step_balance_of_a_run_from_its_metric_files(stdlib_root, tmp_path, micro, capsys):
    # Issue 33: what `shardtool plan --cost-model` predicts, `shardtool stats` reads back from a
    # real run's per-rank metric files: the batches' costs, and the step times the trainer reports.
    from shardtool.cli import main

    world, every = 4, 3
    kw = dict(metrics_dir=str(tmp_path / "m"), metrics_every=every, micro_batches=micro)
    loaders = _loaders(stdlib_root, world, **kw)
    served = []
    for ld in loaders:
        mine = []
        for b in ld:
            mine.append(piece_lengths(b))
            # A trainer whose step takes a nanosecond per unit of cost, plus its own rank's constant.
            ld.report_step_time(1e-9 * _costs([[mine[-1]]])[0, 0] + 1e-3 * ld.rank)
        served.append(mine)
        ld.close()
    costs = _costs(served)
    assert costs.shape[1] % every, "the epoch ends between metric lines: its last steps are in none of them"
    assert main(["stats", str(tmp_path / "m"), "--json", "-"]) == 0
    got = json.loads(capsys.readouterr().out)["balance"]
    # The pass's end writes a line for the steps since the last one: every step counts, with its
    # cost and the time the trainer reported for it (they were lost with the pass).
    whole = costs.shape[1] - costs.shape[1] % micro
    want = step_balance(costs[:, :whole], micro)
    assert got["plan_cost"] == pytest.approx(want)
    times = 1e-9 * costs[:, :whole] + 1e-3 * np.arange(world)[:, None]
    assert got["step_time"] == pytest.approx(step_balance(times, micro))
    assert main(["stats", str(tmp_path / "m")]) == 0
    assert f"step time lost {want['time_lost']:.2%}" in capsys.readouterr().out


def test_report_step_time_before_any_batch_is_refused(stdlib_root):
    (ld,) = _loaders(stdlib_root, 1, metrics=False)
    with pytest.raises(ValueError, match="no batch"):
        ld.report_step_time(0.1)


def test_report_step_time_refuses_what_is_not_a_time_and_stats_skips_it(stdlib_root):
    """A NaN step time made every rank's step sum NaN, and stats printed "step time lost 0.00%"
    for a run where one rank took twice as long as the other."""
    from shardtool.loader.observability.stats import step_balance_of

    (ld,) = _loaders(stdlib_root, 1, metrics=False)
    next(iter(ld))
    for bad in (float("nan"), -1.0, float("inf"), True, "0.1"):
        with pytest.raises(ValueError, match="finite number >= 0"):
            ld.report_step_time(bad)
    ld.report_step_time(np.float32(0.25))  # any real number type
    ld.close()
    # Lines of an older run holding a NaN: its step is left out, the others still count.
    lines = [
        {
            "rank": r,
            "world_size": 2,
            "step_times": [[0, s, (float("nan") if (r, s) == (1, 3) else 1.0 + r)] for s in range(6)],
        }
        for r in range(2)
    ]
    got = step_balance_of(lines)["step_time"]
    assert got is not None and got["time_lost"] == pytest.approx(1 - 1.5 / 2)  # rank 1 twice rank 0


def test_stats_adds_up_a_batchs_step_times_and_counts_a_batch_served_again_once():
    """Two reports for one batch (forward and backward timed apart) made stats drop every step
    without a word; a batch served again after a resume counted twice, and was dropped too."""
    from shardtool.loader.observability.stats import step_balance_of

    def line(rank, times, start=1.0, pid=10):
        return {"rank": rank, "world_size": 2, "start": start, "pid": pid, "step_times": times}

    lines = [
        line(0, [[0, s, 0.25] for s in range(6) for _ in range(2)]),  # forward, then backward: 0.5 a step
        line(1, [[0, s, 1.0] for s in range(4)]),
        # Rank 1 killed after step 3, resumed from a state saved after step 1: steps 2-5 again.
        line(1, [[0, s, 1.0] for s in range(2, 6)], start=2.0, pid=11),
    ]
    got = step_balance_of(lines)["step_time"]
    assert got is not None and got["steps"] == 6
    assert got["time_lost"] == pytest.approx(1 - 0.75 / 1.0)  # every step: rank 1 twice rank 0


def test_a_state_at_an_epochs_start_loads_under_a_calibrated_cost_model(stdlib_root, caplog):
    """Start on a preset, calibrate (a, b), switch at an epoch boundary: the state saved at the
    epoch's end was refused ("start without loading it", which replays from epoch 0). It holds no
    position in the old plan, so the next epoch starts under the new model, with a warning; a state
    inside an epoch is still refused."""
    import logging

    from shardtool.loader import LoaderStateError

    (ld,) = _loaders(stdlib_root, 1)
    it = iter(ld)
    next(it)
    inside = ld.state_dict()
    for _ in it:
        pass
    at_end = ld.state_dict()  # the start of epoch 1
    calibrated = {"a": 1.0, "b": 2.1e-5}
    (resumed,) = _loaders(stdlib_root, 1, cost_model=calibrated)
    with caplog.at_level(logging.WARNING, logger="shardtool.loader.epochs"):
        resumed.load_state_dict(at_end)
    assert resumed.epoch == 1 and "another batching config at the start of epoch 1" in caplog.text
    (fresh,) = _loaders(stdlib_root, 1, cost_model=calibrated)
    fresh.set_epoch(1)
    assert _epoch([resumed]) == _epoch([fresh])
    (again,) = _loaders(stdlib_root, 1, cost_model=calibrated)
    with pytest.raises(LoaderStateError, match="differing: balance"):
        again.load_state_dict(inside)


@pytest.mark.timeout(300)
def test_nodes_reading_one_range_together_serve_its_plan_and_take_a_per_node_state(stdlib_root):
    """``nodes_per_group=2`` on 2 nodes x 2 ranks: one data group of 4 ranks across both nodes,
    so the balanced steps are dealt over all four. Each rank serves that layout's plan, every
    document whole; a state saved by a run of one group a node loads onto it (the groups changed:
    an elastic re-deal), no token served twice."""

    def four(**kw) -> list[ShardedLoader]:
        kw = {"seq_len": SEQ, "batch_size": 2, "eos_id": EOS, "seed": 4, "num_workers": 0, "cost_model": MODEL, **kw}
        return [
            ShardedLoader(stdlib_root, rank=r, world_size=4, ranks_per_node=2, drop_last=False, **kw) for r in range(4)
        ]

    together = four(nodes_per_group=2)
    layout = DataLayout.pure_dp(Layout(2, 2), 2)
    assert together[0].data_layout == layout and layout.group_nodes == ((0, 1),)
    served = _epoch(together)
    sim = simulate_epoch(shardtool.open_dataset(stdlib_root), layout, together[0].batching, cost_model=MODEL)
    assert np.allclose(_costs(served), sim.step_costs, rtol=1e-12)
    whole = _served_tokens(_epoch(four()))
    assert _served_tokens(served) == whole, "the same tokens of every document"

    done, states = served_then_saved(four(), 5, piece_lengths)
    resumed = four(nodes_per_group=2)
    for ld in resumed:
        ld.load_state_dict(states[0])
    leftover = resumed[0].plan.leftover_batches
    got = _served_tokens(done + _epoch(resumed))
    short = {k: whole[k] - got.get(k, 0) for k in whole if got.get(k, 0) != whole[k]}
    assert all(v > 0 for v in short.values()) and sum(short.values()) <= leftover * 2 * SEQ


@pytest.mark.parametrize("outputs", ["full", "lean"])
def test_cost_terms_of_a_served_batch_are_what_the_loader_prices_it(stdlib_root, outputs):
    """To calibrate a cost model, a user times batches and gives `fit_cost_model` each one's
    tokens and squared piece lengths; ``cu_seqlens`` folds a row's padding into its last piece,
    so those are not read off it directly. `cost_terms` gives what the plan prices."""
    from shardtool.loader.packed import cost_terms

    (ld,) = _loaders(stdlib_root, 1, drop_last=False, packed_outputs=outputs)
    terms = [cost_terms(b) for b in ld]
    (full,) = _loaders(stdlib_root, 1, drop_last=False)
    want = _costs([[piece_lengths(b) for b in full]])[0]
    assert [t for t, _ in terms] == [2 * SEQ] * len(want)
    assert np.allclose([MODEL.a * t + MODEL.b * s for t, s in terms], want, rtol=1e-12)
    assert any(s < max(x for _, x in terms) for _, s in terms), "batches of other squares"
