"""A packed mixture whose rows ramp by step (issue 36 item 1, for mixtures):
``ShardedLoader(Mixture(...), seq_len=256, batch_size={0: 2, 4: 3, 9: 6}, steps=...)``.

The composition deals rows, not steps: a step takes its rows from where the steps before it left
off. So a ramp serves, row after row, what a run of one row a step serves; a state saved before, at
or after a change resumes with the uninterrupted run's steps; a ramp changed on resume starts a
new phase in which every source continues its own rows; skipped steps skip the rows they would
have taken. Real data: stdlib files as byte ids (long documents) and short /usr/share/doc files.
"""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardtool
from helpers.realtext import byte_ids, doc_files, stdlib_files
from helpers.runcli import shardtool_cli
from helpers.schedrun import killed_and_resumed
from helpers.skips import require
from shardtool.loader import ShardedLoader
from shardtool.loader.trace import find, traces
from shardtool.plan.mixture import Mixture
from shardtool.plan.mixture.compose import StepUnits

PAD = 999  # byte ids are < 256: a padding position is never a token
SEQ = 256


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    base = tmp_path_factory.mktemp("mixramp")
    code = [p for p in stdlib_files(60) if os.path.getsize(p) > 0]
    docs = [p for p in doc_files() if 0 < os.path.getsize(p) <= 4096][:150]
    require(len(code) >= 50 and len(docs) >= 100, "too few stdlib files or /usr/share/doc files here")
    roots = {}
    for name, paths in (("code", code), ("doc", docs)):
        rows = [{"tokens": byte_ids(p)} for p in paths]
        roots[name] = str(base / name)
        size = sum(r["tokens"].nbytes for r in rows) // 3
        shardtool.pack(rows, roots[name], format="arrow", length="tokens", shard_size=size)
    return roots


def _mix(roots) -> Mixture:
    return Mixture({"code": (roots["code"], 0.7), "doc": (roots["doc"], 0.3)}, max_repeat=50)


def _ranks(roots, world, batch_size, steps, **kw):
    kw = {"num_workers": 0, "seed": 3, "pad_id": PAD, "packing": "best-fit", "seq_len": SEQ, **kw}
    return [
        ShardedLoader(_mix(roots), steps=steps, batch_size=batch_size, rank=r, world_size=world, ranks_per_node=1, **kw)
        for r in range(world)
    ]


def _rows(batch) -> list[tuple[str, bytes]]:
    """(source, the row's token ids) of every row of a step, in order."""
    ids = batch["input_ids"].numpy()
    assert ids.shape[1] == SEQ and len(batch["__source__"]) == ids.shape[0]
    return [(name, row.tobytes()) for name, row in zip(batch["__source__"], ids)]


def _run(loader, stop=None):
    """Rows of every step one pass yields (to step ``stop``), and the state after."""
    got = []
    if stop != loader.step:
        for batch in loader:
            got.append(_rows(batch))
            if loader.step == stop:
                break
    return got, json.loads(json.dumps(loader.state_dict()))


SOURCES = ["code", "doc"]  # a step's rows come source by source, in this order
RAMP = {0: 2, 4: 3, 9: 6}
STEPS = 14
ROWS = StepUnits(tuple(RAMP.items())).before(STEPS)  # 8 + 15 + 30 = 53 rows a rank


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,workers", [(1, 0), (2, 2), (3, 0)])
def test_a_ramp_serves_the_rows_of_one_row_a_step_in_order(sources, world, workers):
    one = _ranks(sources, world, 1, ROWS, num_workers=workers)
    ramp = _ranks(sources, world, RAMP, STEPS, num_workers=workers)
    for a, b in zip(one, ramp):
        assert len(b) == STEPS
        steps, _ = _run(b)
        assert [len(s) for s in steps] == [2] * 4 + [3] * 5 + [6] * 5  # every rank changes at steps 4 and 9
        one_rows = [row for s in _run(a)[0] for row in s]
        at = 0
        for t, step in enumerate(steps):  # the rows of one row a step, taken a step's rows at a time
            size = StepUnits(tuple(RAMP.items())).at(t)
            assert step == sorted(one_rows[at : at + size], key=lambda row: SOURCES.index(row[0]))  # by source
            at += size
        assert at == len(one_rows) == ROWS  # nothing repeated or lost at a change
        assert {n for n, _ in one_rows} == set(SOURCES)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    changes=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 5)), min_size=0, max_size=3),
    first=st.integers(1, 5),
    cut=st.integers(0, 15),
    world=st.sampled_from([1, 2]),
)
def test_a_state_saved_anywhere_resumes_with_the_uninterrupted_steps(sources, changes, first, cut, world):
    ramp = {0: first, **dict(changes)}
    steps = 15
    whole = [_run(ld)[0] for ld in _ranks(sources, world, ramp, steps)]
    for r, ld in enumerate(_ranks(sources, world, ramp, steps)):
        head, state = _run(ld, stop=cut)
        (again,) = [x for i, x in enumerate(_ranks(sources, world, ramp, steps)) if i == r]
        again.load_state_dict(state)
        rest, _ = _run(again)
        assert head + rest == whole[r]
        assert [len(s) for s in whole[r]] == [StepUnits(tuple(sorted(ramp.items()))).at(t) for t in range(steps)]


def _per_source(steps) -> dict[str, list[bytes]]:
    out: dict[str, list[bytes]] = {}
    for s in steps:
        for name, row in s:
            out.setdefault(name, []).append(row)
    return out


@pytest.mark.timeout(300)
def test_a_ramp_changed_on_resume_continues_every_sources_rows(sources, caplog):
    before = _ranks(sources, 2, {0: 2, 4: 4}, 20)
    halves = [_run(ld, stop=6) for ld in before]
    reference = [_per_source(_run(ld)[0]) for ld in _ranks(sources, 2, 1, 200)]  # each source's rows, in order
    changed = _ranks(sources, 2, {0: 2, 8: 6}, 20)
    for r, ld in enumerate(changed):
        with caplog.at_level(logging.WARNING, logger="shardtool.loader.mixed"):
            ld.load_state_dict(halves[r][1])
        assert "rows by step step 0: 2, step 4: 4 -> step 0: 2, step 8: 6" in caplog.text
        rest, state = _run(ld)
        assert [len(s) for s in rest] == [2] * 2 + [6] * 12  # the new ramp from step 6 on: 2 rows until step 8
        served = _per_source(halves[r][0] + rest)
        for name, rows in served.items():
            assert rows == reference[r][name][: len(rows)], name  # a contiguous prefix: no repeat, no gap
        assert state["phase"]["rows"] == [[0, 2], [8, 6]]


@pytest.mark.timeout(300)
def test_an_elastic_resume_under_a_ramp_serves_no_token_twice(sources):
    """3 ranks to step 5, then 2 ranks to the end, the rows ramping at step 4 and 9: per source
    and source-epoch, no token is served more often than its document holds it."""
    served: dict = {}

    def add(loader, steps):
        state = loader.batch_source.state
        for t in steps:
            for name, pieces in loader.planner.step_pieces(state, t):
                for epoch, first, count in pieces:
                    plan = loader.planner.rank_plan(state, name, epoch, loader.dp_rank)
                    rows = plan.rows.take(np.arange(plan.row_offsets[first], plan.row_offsets[first + count]))
                    acc = served.setdefault((name, epoch), {})
                    for pos, n in zip(rows.span_pos.tolist(), rows.span_len.tolist()):
                        acc[pos] = acc.get(pos, 0) + n

    three = _ranks(sources, 3, RAMP, STEPS)
    for ld in three:
        _run(ld, stop=5)
        add(ld, range(5))
    state = three[0].state_dict()
    for ld in _ranks(sources, 2, RAMP, STEPS):
        ld.load_state_dict(state)
        rest, _ = _run(ld)
        assert [len(s) for s in rest] == [StepUnits(tuple(RAMP.items())).at(t) for t in range(5, STEPS)]
        add(ld, range(5, STEPS))
    lengths = {n: shardtool.open_dataset(sources[n]).lengths for n in SOURCES}
    assert {n for n, _ in served} == set(SOURCES)
    for (name, _), acc in served.items():
        assert all(n <= lengths[name][pos] for pos, n in acc.items()), name


@pytest.mark.timeout(300)
def test_skipped_steps_skip_the_rows_they_would_have_taken(sources):
    ramp = {0: 2, 5: 4}
    (whole,) = [_run(ld)[0] for ld in _ranks(sources, 1, ramp, 16)]
    (ld,) = _ranks(sources, 1, ramp, 16)
    _, state = _run(ld, stop=3)
    (again,) = _ranks(sources, 1, ramp, 16)
    again.load_state_dict(state)
    again.skip_steps(4, 7)  # steps 4, 5, 6 would have taken 2 + 4 + 4 rows
    rest, _ = _run(again)
    assert [len(s) for s in rest] == [2, 2] + [4] * 11  # the step numbers go on, and so does the ramp
    assert rest[0] == whole[3]
    got, after = _per_source(rest[1:]), _per_source(whole[7:])  # the data after the skip
    assert sorted(after) == SOURCES and all(got[n][: len(after[n])] == after[n] for n in SOURCES)
    skipped = _per_source(whole[4:7])
    assert all(skipped[n][0] not in got[n] for n in skipped)  # nothing of steps 4..6 is served


def test_trace_and_find_follow_the_ramp(sources):
    (ld,) = _ranks(sources, 1, RAMP, STEPS)
    steps, _ = _run(ld)
    (fresh,) = _ranks(sources, 1, RAMP, STEPS)
    traced = traces(fresh, 0, STEPS)
    assert [max(p["row"] for p in t["samples"]) + 1 for t in traced] == [len(s) for s in steps]
    piece = traced[10]["samples"][-1]
    found = find(fresh, piece["sample"], source=piece["source"])
    assert any(e["step"] == 10 and e["row"] == piece["row"] for e in found)
    for e in found:  # every place found holds the sample's source's row in the served step
        assert steps[e["step"]][e["row"]][0] == piece["source"]


@pytest.mark.timeout(400)
def test_torchrun_ramp_resumed_after_a_kill_matches_the_uninterrupted_run(sources, tmp_path):
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps({"sources": {"code": [sources["code"], 0.7], "doc": [sources["doc"], 0.3]}}))
    saved, runs = killed_and_resumed(str(mix), str(tmp_path), "--mixture")  # rows 4, then 8 from step 10
    assert 1 <= saved["steps"] <= 8  # killed at step 8, before the change at 10
    for whole, resumed in runs:
        start = saved["steps"]
        assert whole["len"] == resumed["len"] == 20 and sorted(map(int, resumed["steps"])) == list(range(start, 20))
        assert all(resumed["steps"][str(s)] == whole["steps"][str(s)] for s in range(start, 20))
        shapes = [whole["steps"][str(s)][2] for s in range(20)]
        assert shapes == [[4, SEQ]] * 10 + [[8, SEQ]] * 10  # the change, on every rank at once
        assert {n for s in range(20) for n in whole["steps"][str(s)][3]} == set(SOURCES)


def test_what_a_mixture_cannot_take_by_step_is_refused(sources):
    with pytest.raises(ValueError, match="batch_size by step is for packed mixtures"):
        ShardedLoader(_mix(sources), steps=10, batch_size={0: 2, 5: 4}, num_workers=0)


def test_plan_shows_the_rows_by_step(sources, tmp_path):
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps({"sources": {"code": [sources["code"], 0.7], "doc": [sources["doc"], 0.3]}}))
    out = shardtool_cli("plan", str(mix), "--steps", "14", "--seq-len", "256", "--batch-size", "0:2,4:3,9:6")
    assert "2 rows (3 from step 4, 6 from step 9) per rank" in out.stdout
    report = json.loads(
        shardtool_cli(
            "plan", str(mix), "--steps", "14", "--seq-len", "256", "--batch-size", "0:2,4:3,9:6", "--json"
        ).stdout
    )
    assert report["rows_by_step"] == [[0, 2], [4, 3], [9, 6]]
    units = sum(s["units_per_rank"] for s in report["sources"].values())
    assert units == ROWS  # the rows the loader serves a rank over the 14 steps


def test_a_ramp_declared_in_the_mixture_file_runs_as_one_given_to_the_loader(sources, tmp_path):
    """issue 36 item 1, "in mixture files": the file's seq_len and batch_size schedule are the
    loader's when it is given none, and shardtool plan and trace read them from the file too."""
    mix = tmp_path / "mix.json"
    spec = {"sources": {"code": [sources["code"], 0.7], "doc": [sources["doc"], 0.3]}, "max_repeat": 50}
    mix.write_text(json.dumps({**spec, "seq_len": SEQ, "batch_size": {str(k): v for k, v in RAMP.items()}}))
    declared = Mixture.from_file(str(mix))
    kw = {"num_workers": 0, "seed": 3, "pad_id": PAD, "rank": 0, "world_size": 2, "ranks_per_node": 1}
    by_file = ShardedLoader(declared, steps=STEPS, **kw)
    (by_args,) = _ranks(sources, 2, RAMP, STEPS)[:1]
    assert _run(by_file)[0] == _run(by_args)[0]
    same = ShardedLoader(declared, steps=STEPS, seq_len=SEQ, batch_size=dict(RAMP), **kw)  # the same, said twice
    assert len(same) == STEPS
    with pytest.raises(ValueError, match="differs from the mixture's batch_size"):
        ShardedLoader(declared, steps=STEPS, batch_size=4, **kw)
    flags = ["--steps", str(STEPS), "--json"]
    from_file = json.loads(shardtool_cli("plan", str(mix), *flags).stdout)
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(spec))
    given = shardtool_cli("plan", str(plain), *flags, "--seq-len", str(SEQ), "--batch-size", "0:2,4:3,9:6")
    assert from_file["rows_by_step"] == json.loads(given.stdout)["rows_by_step"] == [[0, 2], [4, 3], [9, 6]]
    assert from_file["sources"] == json.loads(given.stdout)["sources"]
    trace = ["trace", "--step", "10", "--steps", str(STEPS), "--rank", "1", "--ranks-per-node", "2", "--json"]
    assert json.loads(shardtool_cli(*trace[:1], str(mix), *trace[1:]).stdout) == json.loads(
        shardtool_cli(*trace[:1], str(plain), *trace[1:], "--seq-len", str(SEQ), "--batch-size", "0:2,4:3,9:6").stdout
    )
    clash = shardtool_cli("plan", str(mix), *flags, "--batch-size", "4")
    assert clash.returncode != 0 and "differs from the mixture's batch_size" in clash.stderr
    bare = shardtool_cli("plan", sources["code"])
    assert bare.returncode != 0 and "give --batch-size" in bare.stderr
    for command in (["plan"], ["trace", "--step", "10"]):  # no size in the file or the flags: the same words
        unsized = shardtool_cli(*command, str(plain), "--steps", str(STEPS))
        assert unsized.returncode == 1 and "or batch_size / max_tokens in the mixture file" in unsized.stderr
    trace_clash = shardtool_cli(*trace[:1], str(mix), *trace[1:], "--batch-size", "4")
    assert trace_clash.returncode == 1 and "differs from the mixture's batch_size" in trace_clash.stderr
