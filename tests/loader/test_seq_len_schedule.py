"""Sequence-length warmup (issue 36 item 1): ``seq_len={first step: length}``.

Rows are planned at the longest length; a step of shorter rows takes whole planned rows and cuts
each into rows of its length. So the tokens a warmed-up run serves over an epoch are, in order,
those of the run at the longest length, every rank changes at the same step, and a state saved
before, at or after a change resumes with the uninterrupted run's steps. Real data: stdlib files
as byte ids (long documents) and short /usr/share/doc files.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.packedpieces import packed_pieces, piece_lengths
from helpers.realtext import pack_long_and_short
from helpers.runcli import shardtool_cli
from helpers.schedrun import RESUME_DRAWS, changes_of, killed_and_resumed, state_after
from shardtool.loader import ShardedLoader
from shardtool.loader.trace import find, trace, traces
from shardtool.plan.cost import CostModel, step_balance
from shardtool.plan.packing import Rows
from shardtool.plan.rowsplit import cut_pieces, cut_rows, cut_squares
from shardtool.plan.schedule import parse_schedule, with_seq_lens

PAD = 999  # byte ids are < 256: a padding position is never a token


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return pack_long_and_short(str(tmp_path_factory.mktemp("seqsched") / "arrow"), 160, 120, least=200)


def _ranks(url, world, **kw):
    kw.setdefault("num_workers", 0)
    kw.setdefault("pad_id", PAD)
    return [
        ShardedLoader(url, rank=r, world_size=world, ranks_per_node=world, pin_memory=False, **kw) for r in range(world)
    ]


def _stream(batches) -> np.ndarray:
    """The real tokens of ``batches``' rows, row after row (padding left out)."""
    ids = [b["input_ids"].numpy().reshape(-1) for b in batches]
    flat = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    return flat[flat != PAD]


WARMUP = {0: 256, 4: 512, 9: 1024}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "world,workers,packing,outputs",
    [(1, 0, "best-fit", "full"), (3, 0, "best-fit", "full"), (2, 2, "stream", "lean"), (1, 0, "no-split", "full")],
)
def test_a_warmup_serves_the_longest_rows_tokens_in_order(corpus, world, workers, packing, outputs):
    kw = dict(packing=packing, packed_outputs=outputs, seed=5, num_workers=workers, token_fields=[])
    # 8 rows at 256 tokens: two planned rows of 1,024, the plan's batch (the schedule's base).
    base = _ranks(corpus, world, seq_len=1024, batch_size=2, **kw)
    warm = _ranks(corpus, world, seq_len=WARMUP, batch_size=8, **kw)
    schedule = with_seq_lens(8, parse_schedule("seq_len", WARMUP))
    assert schedule.base == 2 and {len(ld) for ld in warm} == {len(warm[0])}  # equal counts
    for b, w in zip(base, warm):
        n = len(w)  # (read before the pass: after it, the next epoch's steps, all of the longest rows)
        got = list(w)
        assert len(got) == n < len(b)
        for t, batch in enumerate(got):  # every step: 8 rows of its length
            assert batch["input_ids"].shape == (8, schedule.seq_len_at(t))
        assert np.array_equal(_stream(got), _stream(list(b)))  # the same tokens, in order
        if outputs == "full":
            for batch in got:  # labels never reach into the next row, where a cut went through a document
                lab, ids = batch["labels"][:, :-1], batch["input_ids"][:, 1:]
                assert torch.equal(lab[lab != -100], ids[lab != -100])
                cu = batch["cu_seqlens"].numpy()
                ends = cu[1:][cu[1:] > cu[:-1]] - 1  # every piece's last position: no label past a cut
                assert (batch["labels"].reshape(-1).numpy()[ends] == -100).all()


@pytest.mark.timeout(300)
def test_a_warmup_with_a_batch_size_ramp_keeps_the_tokens(corpus):
    # Tokens per step held at 4,096 while rows grow, then doubled: rows 16 -> 8 -> 8.
    sizes, lengths = {0: 16, 6: 8}, {0: 256, 6: 512, 12: 1024}
    warm = ShardedLoader(corpus, seq_len=lengths, batch_size=sizes, seed=2, pad_id=PAD, token_fields=[])
    base = ShardedLoader(corpus, seq_len=1024, batch_size=4, seed=2, pad_id=PAD, token_fields=[])
    got = list(warm)
    shapes = [tuple(b["input_ids"].shape) for b in got]
    assert shapes[:6] == [(16, 256)] * 6 and shapes[6:12] == [(8, 512)] * 6
    assert set(shapes[12:]) == {(8, 1024)}
    assert np.array_equal(_stream(got), _stream(list(base)))


@pytest.mark.timeout(600)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.sampled_from([256, 512, 1024]), min_size=2, max_size=4),
    **RESUME_DRAWS,
)
def test_a_resume_before_at_or_after_a_change_continues_the_run(
    corpus, lengths, gaps, world, world_after, workers, stop, seed
):
    changes = changes_of(lengths, gaps)
    kw = dict(seq_len=changes, batch_size=16, seed=seed, token_fields=[])
    whole = [list(ld) for ld in _ranks(corpus, world, **kw)]
    n = len(whole[0])
    stop = min(stop, n - 1)  # (after the last step the state is the next epoch's start)
    state = state_after(_ranks(corpus, world, **kw), stop)
    resumed = _ranks(corpus, world_after, num_workers=workers, **kw)
    for ld in resumed:
        ld.load_state_dict(state)
    rest = [list(ld) for ld in resumed]
    assert len({len(r) for r in rest}) == 1  # equal counts after the resume too
    schedule = with_seq_lens(16, parse_schedule("seq_len", changes))
    for r in rest:  # each step after the resume has its scheduled length
        for t, b in enumerate(r, start=stop):
            assert b["input_ids"].shape[1] == schedule.seq_len_at(t)
    if world_after == world:  # the same layout: the uninterrupted run's steps, exactly
        for w, r in zip(whole, rest):
            assert len(r) == len(w) - stop
            for a, b in zip(w[stop:], r):
                assert torch.equal(a["input_ids"], b["input_ids"])
        return
    if stop == 0:  # nothing served: the epoch is planned afresh on the new layout, exactly its run
        # (One rank drops nothing where several drop their surplus: the old layout's run is no bound.)
        for f, r in zip([list(ld) for ld in _ranks(corpus, world_after, **kw)], rest):
            assert len(f) == len(r) and all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(f, r))
        return
    # Another layout: the rest re-dealt; no token served twice beyond what the corpus holds.
    served = np.concatenate([_stream(w[:stop]) for w in whole] + [_stream(r) for r in rest])
    every = np.concatenate([_stream(w) for w in whole])
    assert (np.bincount(served, minlength=256) <= np.bincount(every, minlength=256)).all()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2])
def test_a_warmed_up_steps_trace_is_the_step_served(corpus, world):
    kw = dict(seq_len=WARMUP, batch_size=8, seed=4, pad_id=PAD, token_fields=[], rank=world - 1, world_size=world)
    ld, probe = ShardedLoader(corpus, **kw), ShardedLoader(corpus, **kw)
    for t, batch in enumerate(ld):
        if t > 14:
            break
        pieces = trace(probe, t)["samples"]
        assert [(p["row"], p["key"], p["offset"]) for p in pieces] == packed_pieces(batch)
        row_tokens = np.zeros(batch["input_ids"].shape[0], np.int64)
        for p in pieces:
            row_tokens[p["row"]] += p["length"]
        assert np.array_equal(row_tokens, (batch["input_ids"] != PAD).sum(1).numpy())


def test_shardtool_plan_and_trace_show_a_warmup(corpus):
    res = shardtool_cli("plan", corpus, "--batch-size", "8", "--seq-len", "0:256,4:512,9:1024", "--json")
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    ld = ShardedLoader(corpus, seq_len=WARMUP, batch_size=8, num_workers=0)
    assert got["batching"]["seq_len"] == 1024 and got["schedule"]["steps"] == len(ld)
    phases = [(p["size"], p["seq_len"], p["steps"]) for p in got["schedule"]["phases"]]
    assert phases == [(8, 256, 4), (8, 512, 5), (8, 1024, len(ld) - 9)]
    text = shardtool_cli("plan", corpus, "--batch-size", "8", "--seq-len", "0:256,4:512,9:1024")
    assert text.returncode == 0 and "steps 4..8: size 8 x 512 tokens x 5 steps" in text.stdout, text.stdout
    one = shardtool_cli(
        "trace", corpus, "--batch-size", "8", "--seq-len", "0:256,4:512,9:1024", "--step", "5", "--json"
    )
    assert one.returncode == 0, one.stderr
    assert json.loads(one.stdout)["samples"] == trace(ld, 5)["samples"]
    bad = shardtool_cli("plan", corpus, "--batch-size", "2", "--seq-len", "0:256,4:1024")
    assert bad.returncode != 0 and "multiple of 4" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.timeout(400)
def test_torchrun_warmup_resumed_after_a_kill_matches_the_uninterrupted_run(corpus, tmp_path):
    saved, runs = killed_and_resumed(corpus, str(tmp_path), "--warmup")
    assert 1 <= saved["steps"] <= 8  # killed at step 8, before the change at 10
    for whole, resumed in runs:
        start = saved["steps"]
        assert resumed["len"] == whole["len"] and sorted(map(int, resumed["steps"])) == list(range(start, whole["len"]))
        assert all(resumed["steps"][str(s)] == whole["steps"][str(s)] for s in range(start, whole["len"]))
        shapes = [whole["steps"][str(s)][2] for s in range(whole["len"])]
        assert shapes == [[4, 256]] * 10 + [[4, 512]] * (whole["len"] - 10)  # the change, on every rank at once


def test_a_warmup_that_cannot_cut_whole_rows_is_refused(corpus):
    with pytest.raises(ValueError, match="does not divide the longest seq_len 1024"):
        ShardedLoader(corpus, seq_len={0: 384, 10: 1024}, batch_size=8)
    with pytest.raises(ValueError, match="multiple of 4"):
        ShardedLoader(corpus, seq_len={0: 256, 10: 1024}, batch_size=2)
    with pytest.raises(ValueError, match="needs batch_size"):
        ShardedLoader(corpus, seq_len={0: 256, 10: 1024}, max_tokens=4096)


def _rows(draw_rows) -> Rows:
    seq_len, rows = draw_rows
    offsets, pos, start, length = [0], [], [], []
    for r, spans in enumerate(rows):
        room = seq_len
        for k, n in enumerate(spans):
            n = min(n, room)
            if n < 1:
                break
            pos.append(100 * r + k)
            start.append(7 * k)
            length.append(n)
            room -= n
        offsets.append(len(pos))
    return Rows(seq_len, *(np.asarray(v, np.int64) for v in (offsets, pos, start, length)), np.zeros(0, np.int64), 0)


@settings(max_examples=200, deadline=None)
@given(
    shape=st.tuples(
        st.sampled_from([8, 16, 64]),
        st.lists(st.lists(st.integers(1, 70), max_size=6), max_size=6),
    ),
    parts=st.sampled_from([2, 4, 8]),
)
def test_cut_rows_keeps_every_token_in_order(shape, parts):
    rows = _rows(shape)
    assert cut_rows(rows, rows.seq_len) is rows
    n = rows.seq_len // parts
    cut = cut_rows(rows, n)

    def tokens(r: Rows) -> list[tuple[int, int]]:
        return [
            (p, s + i)
            for p, s, m in zip(r.span_pos.tolist(), r.span_start.tolist(), r.span_len.tolist())
            for i in range(m)
        ]

    assert tokens(cut) == tokens(rows)
    assert cut.seq_len == n and (cut.row_tokens() <= n).all() and (cut.row_tokens() > 0).all()
    assert (np.diff(cut.row_offsets) > 0).all() or cut.num_rows == 0
    # Each cut row lies within one stretch [j n, (j + 1) n) of one row: as many rows as stretches used.
    used = sum(-(-int(t) // n) for t in rows.row_tokens())
    assert cut.num_rows == used
    batches = np.array([0, rows.num_rows // 2, rows.num_rows], np.int64)
    counts = cut_pieces(rows, batches, np.array([n, n]))
    assert counts.sum() == len(cut.span_pos)
    # What a cut batch's attention costs: its pieces' squares, each batch cut to its own length.
    lens = np.array([n, rows.seq_len])
    squares = cut_squares(rows, batches, lens)
    for b, m in enumerate(lens.tolist()):
        part = cut_rows(rows.slice(int(batches[b]), int(batches[b + 1])), m)
        assert squares[b] == float((part.span_len.astype(np.float64) ** 2).sum())


@pytest.mark.timeout(300)
def test_the_warmup_pieces_benchmark_compares_cut_and_packed_rows():
    res = subprocess.run(
        [sys.executable, "-m", "shardtool.benchmarks.warmup_pieces", "--docs", "150", "--max-bytes", "4096"]
        + ["--lengths", "256,512", "--longest", "1024"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert res.returncode == 0, res.stderr
    lines = {
        ln.split("  ")[1].strip(): ln for ln in res.stdout.splitlines() if ln.startswith("  ") and "rows of" not in ln
    }
    assert set(lines) == {
        "1,024 (the plan)",
        "256 packed at 256",
        "256 cut from 1,024",
        "512 packed at 512",
        "512 cut from 1,024",
    }
    fill = {k: float(v.split()[-4]) for k, v in lines.items()}
    assert fill["256 cut from 1,024"] >= fill["1,024 (the plan)"]  # a planned row's padding falls in one part


SCHEDULED = {
    "ramp": dict(batch_size={0: 2, 5: 4, 12: 8}),
    "packed ramp": dict(batch_size={0: 1, 3: 2, 9: 4}, seq_len=256, token_fields=[]),
    "warmup": dict(batch_size=8, seq_len=WARMUP, token_fields=[]),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", sorted(SCHEDULED))
def test_find_in_a_scheduled_run_gives_the_steps_that_serve_the_sample(corpus, kind):
    world = 2
    loaders = [
        ShardedLoader(corpus, rank=r, world_size=world, ranks_per_node=world, seed=6, num_workers=0, **SCHEDULED[kind])
        for r in range(world)
    ]
    where: dict[int, set] = {}  # every sample's entries, from the trace of every step of every rank
    for ld in loaders:
        for t in traces(ld, 0, len(ld)):
            for u in t["samples"]:
                entry = (t["dp_rank"], t["step"], u.get("row"), u.get("offset"), u["length"])
                where.setdefault(u["sample"], set()).add(entry)
    for s in np.random.default_rng(0).choice(sorted(where), 30, replace=False).tolist():
        got = [(e["dp_rank"], e["step"], e.get("row"), e.get("offset"), e["length"]) for e in find(loaders[0], s)]
        assert len(got) == len(set(got)) and set(got) == where[s]


@pytest.mark.timeout(300)
def test_a_warmup_that_changes_inside_a_later_epoch_traces_that_epoch(corpus):
    # Epoch 0's steps, all at 256 (rows cut from the same plan: the change comes later).
    first = len(ShardedLoader(corpus, seq_len={0: 256, 10**6: 1024}, batch_size=8, num_workers=0))
    kw = dict(seq_len={0: 256, first + 3: 1024}, batch_size=8, seed=3, pad_id=PAD, token_fields=[])
    ld, probe = ShardedLoader(corpus, **kw), ShardedLoader(corpus, **kw)
    assert len(ld) == first
    ld.set_epoch(1)
    probe.set_epoch(1)
    for t, batch in enumerate(ld):
        assert batch["input_ids"].shape == (8, 256 if t < 3 else 1024)
        assert [(p["row"], p["key"], p["offset"]) for p in trace(probe, t)["samples"]] == packed_pieces(batch)
        if t == 6:
            break


@pytest.mark.timeout(300)
def test_a_ramp_with_a_cost_model_balances_its_steps(corpus):
    """Issue 36 with 33: a batch-size ramp under a cost model. Each planned batch is balanced
    across the DP ranks, so the steps that join them are too, measured from what is served."""
    world, model = 4, CostModel.parse("llama-7b")

    def served(**kw) -> tuple[np.ndarray, np.ndarray]:
        costs, tokens = [], []
        for ld in _ranks(corpus, world, seq_len=4096, batch_size={0: 1, 5: 2, 15: 4}, seed=2, token_fields=[], **kw):
            batches = list(ld)
            pieces = [np.diff(b["cu_seqlens"].numpy().astype(np.float64)) for b in batches]
            costs.append([model.a * b["input_ids"].numel() + model.b * (p**2).sum() for b, p in zip(batches, pieces)])
            tokens.append(_stream(batches))
        return np.array(costs), np.sort(np.concatenate(tokens))

    balanced, got = served(cost_model="llama-7b")
    plain, want = served()
    assert balanced.shape == plain.shape  # the same steps on every rank
    assert np.array_equal(got, want)  # the same tokens served, only ordered otherwise
    lost, before = step_balance(balanced)["time_lost"], step_balance(plain)["time_lost"]
    assert lost < before / 2 and lost < 0.02, (lost, before)
    # With gradient accumulation, M loader steps make a step: what each rank does over them is
    # evened, and the same tokens are served.
    accumulated, again = served(cost_model="llama-7b", micro_batches=2)
    assert np.array_equal(again, want)
    lost, before = step_balance(accumulated, 2)["time_lost"], step_balance(plain, 2)["time_lost"]
    assert lost < before / 2 and lost < 0.02, (lost, before)


def test_shardtool_plan_balances_a_ramps_steps(corpus):
    args = ("plan", corpus, "--seq-len", "4096", "--cost-model", "llama-7b", "--ranks-per-node", "4", "--json")
    res = shardtool_cli(*args, "--batch-size", "0:1,5:2,15:4")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    steps = report["schedule"]["steps"]
    for side in ("balanced", "unbalanced"):  # the schedule's steps, not the planned batches
        assert report["compute_balance"][side]["steps"] == steps < report["batches_per_rank"]
    assert report["compute_balance"]["balanced"]["time_lost"] < report["compute_balance"]["unbalanced"]["time_lost"]
    accumulated = shardtool_cli(*args, "--batch-size", "0:1,5:2,15:4", "--micro-batches", "2")
    assert accumulated.returncode == 0, accumulated.stderr
    both = json.loads(accumulated.stdout)["compute_balance"]
    assert both["micro_batches"] == 2 and both["balanced"]["steps"] == (steps + 1) // 2
    assert both["balanced"]["time_lost"] < both["unbalanced"]["time_lost"]


@pytest.mark.timeout(300)
def test_a_warmup_with_a_cost_model_balances_its_cut_steps(corpus, tmp_path, capsys):
    """Issue 36 with 33: rows planned at 4,096 and balanced by their cost, served cut to 1,024 for
    the warmup's steps. A cut row's pieces are not its planned row's, but rows of like cost cut
    alike: the cut steps stay even. What the ranks serve is what the metric lines (`shardtool
    stats`) and `shardtool plan` say the steps cost, cut."""
    from shardtool.cli import main

    world, model, every = 4, CostModel.parse("llama-7b"), 3
    kw = dict(seq_len={0: 1024, 6: 4096}, batch_size=8, seed=2, token_fields=[], eos_id=256)

    def served(**more) -> np.ndarray:
        costs = []
        for ld in _ranks(corpus, world, **kw, **more):
            # Every row of a step runs the linear layers, a padding row too (the epoch's last step).
            costs.append(
                [model.a * b["input_ids"].numel() + model.b * sum(n * n for *_, n in piece_lengths(b)) for b in ld]
            )
            ld.close()
        return np.array(costs)

    balanced = served(cost_model="llama-7b", metrics_dir=str(tmp_path / "m"), metrics_every=every)
    plain = served()
    assert balanced.shape == plain.shape and balanced.shape[1] > 6
    for part in (slice(0, 6), slice(6, None)):  # the warmup's cut steps, then the rows as planned
        lost, before = step_balance(balanced[:, part])["time_lost"], step_balance(plain[:, part])["time_lost"]
        assert lost < before / 2 and lost < 0.02, (part, lost, before)
    assert main(["stats", str(tmp_path / "m"), "--json", "-"]) == 0
    # Every step: the epoch's end writes a line for the steps after the last periodic one.
    assert json.loads(capsys.readouterr().out)["balance"]["plan_cost"] == pytest.approx(step_balance(balanced))
    args = ("plan", corpus, "--seq-len", "0:1024,6:4096", "--batch-size", "8", "--seed", "2", "--eos-id", "256")
    res = shardtool_cli(*args, "--cost-model", "llama-7b", "--ranks-per-node", str(world), "--json")
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)["compute_balance"]
    assert got["balanced"] == pytest.approx(step_balance(balanced))
    assert got["unbalanced"] == pytest.approx(step_balance(plain))


def test_skipping_a_warmups_steps_by_state_edit_equals_skip_steps(corpus, tmp_path):
    kw = dict(seq_len=WARMUP, batch_size=8, seed=8, pad_id=PAD, token_fields=[])
    ld = ShardedLoader(corpus, **kw)
    it = iter(ld)
    for _ in range(3):
        next(it)
    path = tmp_path / "state.json"
    path.write_text(json.dumps(ld.state_dict()))
    res = shardtool_cli(
        "state", "skip", str(path), "--steps", "5:11", "--batch-size", "8", "--seq-len", "0:256,4:512,9:1024"
    )
    assert res.returncode == 0, res.stderr
    edited, direct = ShardedLoader(corpus, **kw), ShardedLoader(corpus, **kw)
    edited.load_state_dict(json.loads(path.read_text()))
    direct.load_state_dict(ld.state_dict())
    direct.skip_steps(5, 11)
    assert len(edited) == len(direct) < len(ld)
    for t, (a, b) in enumerate(zip(edited, direct), start=3):  # step 5 takes step 11's data, at step 5's length
        assert torch.equal(a["input_ids"], b["input_ids"])
        assert a["input_ids"].shape[1] == with_seq_lens(8, parse_schedule("seq_len", WARMUP)).seq_len_at(t)
        if t == 12:
            break
