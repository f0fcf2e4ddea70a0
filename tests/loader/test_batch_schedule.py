"""Batch-size ramps (issue 36 item 1): ``batch_size={first step: size}``.

The plan is made at the schedule's base size (the sizes' gcd) and step t takes the next
size(t) / base planned batches: so the samples (packed: rows) a scheduled run serves over an
epoch are, in order, those of the run at the base size, every rank changes at the same step,
and a state saved before, at or after a change resumes with the uninterrupted run's steps, on
the same layout or another. Real data: stdlib files as byte ids and short /usr/share/doc files.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.packedpieces import packed_pieces
from helpers.realtext import pack_long_and_short
from helpers.runcli import shardtool_cli
from helpers.schedrun import changes_of, killed_and_resumed, state_after
from shardtool.loader import Mixture, ShardedLoader
from shardtool.loader.trace import dump, find, sample_of, trace
from shardtool.plan.schedule import parse_schedule


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return {
        fmt: pack_long_and_short(str(tmp_path_factory.mktemp("sched") / fmt), 200, 160, least=300, fmt=fmt, paths=True)
        for fmt in ("arrow", "tar")
    }


def _keys(batch) -> list:
    return list(batch["__key__"])


def _ranks(url, world, **kw):
    kw.setdefault("num_workers", 0)
    return [
        ShardedLoader(url, rank=r, world_size=world, ranks_per_node=world, pin_memory=False, **kw) for r in range(world)
    ]


RAMP = {0: 2, 5: 4, 12: 8}


def _efficiency(batches) -> float:
    """Real tokens / padded tokens of bucketed batches (their ``lengths``)."""
    real = sum(int(b["lengths"].sum()) for b in batches)
    return real / sum(int(b["lengths"].max()) * len(b["lengths"]) for b in batches)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,workers", [(1, 0), (3, 0), (3, 2)])
def test_a_ramp_serves_every_sample_once_with_the_scheduled_sizes(corpus, world, workers):
    base = _ranks(corpus["arrow"], world, batch_size=2, seed=3, num_workers=workers)
    ramp = _ranks(corpus["arrow"], world, batch_size=RAMP, seed=3, num_workers=workers)
    lens = {len(ld) for ld in ramp}
    assert len(lens) == 1  # equal counts: every rank takes the same steps
    n = lens.pop()
    schedule = parse_schedule("batch_size", RAMP)
    every, served = [], []
    for b, r in zip(base, ramp):
        every += [k for x in b for k in _keys(x)]
        got = [_keys(x) for x in r]
        assert len(got) == n
        served += [k for g in got for k in g]
        sizes = [len(g) for g in got]
        assert sizes[:-1] == [schedule.size_at(t) for t in range(len(got) - 1)]
        assert 1 <= sizes[-1] <= schedule.size_at(len(got) - 1)  # the epoch's last step may be short
        b.close()
        r.close()
    # Nothing lost or repeated: the samples of the run at the base size, each once.
    assert len(served) == len(set(served)) and sorted(served) == sorted(every)


@pytest.mark.timeout(300)
def test_a_bucketed_ramps_steps_pad_less_than_joined_batches_of_the_base_size(corpus):
    """A step joins consecutive planned batches; they are dealt in runs of like lengths
    (`Batching.run_batches`), so a step pads far less than the same number of batches of the
    base plan, which are shuffled one by one, would when joined."""
    schedule = parse_schedule("batch_size", RAMP)
    ramp = ShardedLoader(corpus["arrow"], batch_size=RAMP, seed=5, num_workers=0)
    assert ramp.batching.run_batches == 4 * 8 // 2
    steps = [b for b in ramp]
    base = [b for b in ShardedLoader(corpus["arrow"], batch_size=2, seed=5, num_workers=0)]
    cut = schedule.cut(0, len(base))
    joined = [{"lengths": torch.cat([base[i]["lengths"] for i in range(a, z)])} for a, z in zip(cut[:-1], cut[1:])]
    big = [b for b in steps if len(b["lengths"]) > 2]
    assert _efficiency(big) > _efficiency([b for b in joined if len(b["lengths"]) > 2]) + 0.05


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "packing,outputs,seq_len,workers",
    [("best-fit", "full", 1024, 0), ("stream", "lean", 256, 2), ("no-split", "full", 2048, 0)],
)
def test_a_ramp_of_packed_rows_serves_the_base_runs_rows(corpus, packing, outputs, seq_len, workers):
    kw = dict(seq_len=seq_len, packing=packing, packed_outputs=outputs, seed=1, num_workers=workers, pin_memory=False)
    kw["token_fields"] = []
    ramp = {0: 1, 3: 2, 9: 4}
    base = [b["input_ids"] for b in ShardedLoader(corpus["tar"], batch_size=1, **kw)]
    ld = ShardedLoader(corpus["tar"], batch_size=ramp, **kw)
    n = len(ld)
    got = list(ld)
    assert len(got) == n and n < len(base)
    schedule = parse_schedule("batch_size", ramp)
    for t, batch in enumerate(got):  # every step's rows: the schedule's size, the last padded to it
        assert batch["input_ids"].shape == (schedule.size_at(t), seq_len)
    rows = torch.cat([b["input_ids"] for b in got])
    want = torch.cat(base)
    assert torch.equal(rows[: want.shape[0]], want)
    assert not rows[want.shape[0] :].any()  # the short last step's padding rows
    if outputs == "full":
        for batch in got:  # each row's labels: its own tokens shifted, never the next row's
            assert torch.equal(
                batch["labels"][:, :-1][batch["labels"][:, :-1] != -100],
                batch["input_ids"][:, 1:][batch["labels"][:, :-1] != -100],
            )


def _run_from(url, world, state, **kw):
    loaders = _ranks(url, world, **kw)
    if state is not None:
        for ld in loaders:
            ld.load_state_dict(state)
    return loaders


@pytest.mark.timeout(600)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.sampled_from([1, 2, 3, 4, 6]), min_size=2, max_size=4),
    gaps=st.lists(st.integers(1, 12), min_size=3, max_size=3),
    world=st.integers(1, 3),
    world_after=st.integers(1, 3),
    stop=st.integers(0, 60),
    seed=st.integers(0, 3),
)
def test_a_resume_before_at_or_after_a_change_continues_the_run(corpus, sizes, gaps, world, world_after, stop, seed):
    changes = changes_of(sizes, gaps)
    kw = dict(batch_size=changes, seed=seed)
    whole = [[_keys(b) for b in ld] for ld in _ranks(corpus["arrow"], world, **kw)]
    n = len(whole[0])
    stop = min(stop, n - 1)  # (after the last step the state is the next epoch's start)
    state = state_after(_ranks(corpus["arrow"], world, **kw), stop)
    if world_after == world:  # the same layout: the uninterrupted run's steps, exactly
        rest = [[_keys(b) for b in ld] for ld in _run_from(corpus["arrow"], world, state, **kw)]
        assert rest == [w[stop:] for w in whole]
        return
    # Another layout: the rest of the epoch re-dealt; still nothing repeated, equal counts.
    resumed = _run_from(corpus["arrow"], world_after, state, **kw)
    left = {ld.batches_left for ld in resumed}
    leftover = resumed[0].plan.leftover_batches  # (read before the pass: after it, the next epoch's)
    assert len({len(ld) for ld in resumed}) == 1 and len(left) == 1
    rest = [[_keys(b) for b in ld] for ld in resumed]
    assert {len(r) for r in rest} == left
    served = [k for w in whole for b in w[:stop] for k in b] + [k for r in rest for b in r for k in b]
    assert len(served) == len(set(served))
    every = [k for w in whole for b in w for k in b]
    # What the re-deal left over (whole base batches, fewer than the new DP size) is all that is missing.
    missing = set(every) - set(served)
    assert len(missing) <= leftover * world_after * sizes_base(changes)
    # The steps after the resume take the sizes the schedule gives those steps.
    schedule = parse_schedule("batch_size", changes)
    for t, b in enumerate(rest[0][:-1], start=stop):
        assert len(b) == schedule.size_at(t)


def sizes_base(changes) -> int:
    return parse_schedule("batch_size", changes).base


@pytest.mark.timeout(300)
def test_the_steps_go_on_across_epochs(corpus):
    kw = dict(batch_size={0: 2, 40: 4, 120: 8}, seed=2)
    ld = _ranks(corpus["arrow"], 1, **kw)[0]
    schedule = parse_schedule("batch_size", kw["batch_size"])
    step, sizes, states = 0, [], {}
    for epoch in range(3):
        assert ld.epoch == epoch
        n = len(ld)
        for j, batch in enumerate(ld):
            sizes.append((step, len(batch["__key__"]), j == n - 1))
            step += 1
            if j == 3:
                states[epoch] = ld.state_dict()
    assert all(size == schedule.size_at(t) for t, size, last in sizes if not last)
    # A state of epoch 1 resumes at the run's step (the schedule counts the run's steps).
    again = _ranks(corpus["arrow"], 1, **kw)[0]
    again.load_state_dict(states[1])
    first_of_1 = next(t for t, _, last in sizes if last) + 1
    assert states[1]["step"] == first_of_1
    got = [len(b["__key__"]) for b in again]
    want = [size for t, size, _ in sizes if first_of_1 + 4 <= t < first_of_1 + 4 + len(got)]
    assert got == want
    # A fresh loader asked for epoch 2 counts the run's steps as whole epochs did.
    fresh = _ranks(corpus["arrow"], 1, **kw)[0]
    fresh.set_epoch(2)
    first_of_2 = [t for t, _, last in sizes if last][1] + 1
    assert [len(b["__key__"]) for b in fresh] == [size for t, size, _ in sizes if t >= first_of_2]
    # A state without a schedule's step (saved by a loader of the base size: packed rows, whose
    # plan a schedule leaves as it is) counts the run's steps as whole epochs would have.
    rows = dict(seq_len=512, seed=2, token_fields=[])
    plain = _ranks(corpus["arrow"], 1, batch_size=1, **rows)[0]
    plain.set_epoch(2)
    moved = _ranks(corpus["arrow"], 1, batch_size={0: 1, 30: 2}, **rows)[0]
    moved.load_state_dict(plain.state_dict())
    ahead = _ranks(corpus["arrow"], 1, batch_size={0: 1, 30: 2}, **rows)[0]
    ahead.set_epoch(2)
    assert "step" not in plain.state_dict() and len(moved) == len(ahead)
    assert [b["input_ids"].shape[0] for b in moved] == [b["input_ids"].shape[0] for b in ahead] != []


def test_a_schedule_is_refused_where_it_cannot_work_yet(corpus):
    url = corpus["arrow"]
    for kw, words in [
        (dict(batch_size={5: 4}), "from step 0"),
        (dict(batch_size={0: 4, 10: 0}), "sizes (ints >= 1)"),
        (dict(batch_size={0: 4, 10: 8}, exact=True), "exact=True"),
        (dict(max_tokens={0: 4096, 10: 8192}, batch_size=4), "without batch_size and seq_len"),
    ]:
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            ShardedLoader(url, num_workers=0, **kw)
    with pytest.raises(ValueError, match="batch_size by step is for packed mixtures"):  # a packed one ramps
        ShardedLoader(Mixture({"a": (url, 1.0)}), batch_size={0: 2, 4: 4}, steps=10, num_workers=0)
    # One size is no schedule: the loader (and its states) are those of batch_size=size.
    one = ShardedLoader(url, batch_size={0: 4}, num_workers=0, seed=1)
    assert (
        one.schedule is None
        and one.state_dict() == ShardedLoader(url, batch_size=4, num_workers=0, seed=1).state_dict()
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("packed", [False, True], ids=["bucketed", "packed"])
def test_skipping_steps_of_a_ramp_moves_the_data_past_them(corpus, world, packed):
    """A ramp rolled back to step 6 skipping steps 9..12 (across its change at step 12's
    neighbourhood): the steps go on counting with the schedule's sizes, the data of the skipped
    steps is never served, every other sample once; a later resume keeps the skip."""
    kw = dict(batch_size={0: 1, 5: 2, 11: 4}, seed=6)
    if packed:
        kw.update(seq_len=512, token_fields=[])

    def units(batch) -> list:
        """A batch's samples (keys), or its rows (their tokens: a long document's pieces share keys)."""
        if not packed:
            return _keys(batch)
        return [row.numpy().tobytes() for row in batch["input_ids"] if row.any()]

    run = [[units(b) for b in ld] for ld in _ranks(corpus["arrow"], world, **kw)]
    first = _ranks(corpus["arrow"], world, **kw)
    for ld in first:
        it = iter(ld)
        for _ in range(6):
            next(it)
    state = first[0].state_dict()
    resumed = _run_from(corpus["arrow"], world, state, **kw)
    for ld in resumed:
        ld.skip_steps(9, 13)
    n = len(run[0])
    schedule = parse_schedule("batch_size", kw["batch_size"])
    sizes_kw = "input_ids" if packed else "__key__"
    mid = None
    for r, ld in enumerate(resumed):
        assert len(ld) < n
        got = []
        for j, batch in enumerate(ld, start=6):
            got.append(units(batch))
            if j < len(ld) - 1:
                assert len(batch[sizes_kw]) == schedule.size_at(j)  # the steps go on counting
            if r == 0 and j == 10:
                mid = ld.state_dict()
        assert got[:3] == run[r][6:9]  # before the skip: the run's own steps
        # After it, the data of the run's steps 13 on, in order, in steps of the schedule's sizes:
        # the skipped steps' data never, every other unit once.
        assert [u for b in got for u in b] == [u for b in run[r][6:9] + run[r][13:] for u in b]
    if world == 1:  # `shardtool state skip` takes the schedule the file does not hold, as the loader had it
        path = os.path.join(os.path.dirname(corpus["arrow"]), f"sched-state-{int(packed)}.json")
        with open(path, "w") as f:
            json.dump(mid, f)
        res = shardtool_cli("state", "skip", path, "--steps", "20:22")
        assert res.returncode != 0 and "--batch-size 0:4,2000:8" in res.stderr, res.stderr
        res = shardtool_cli("state", "skip", path, "--steps", "20:22", "--batch-size", "0:2,5:4")
        assert res.returncode != 0 and "planned at batch_size 1" in res.stderr, res.stderr
        res = shardtool_cli("state", "skip", path, "--steps", "20:22", "--batch-size", "0:1,5:2,11:4")
        assert res.returncode == 0, res.stderr
        with open(path) as f:
            edited = _run_from(corpus["arrow"], 1, json.load(f), **kw)[0]
        direct = _run_from(corpus["arrow"], 1, mid, **kw)[0]
        direct.skip_steps(20, 22)
        assert edited.state_dict() == direct.state_dict()
        assert [units(b) for b in edited] == [units(b) for b in direct]
        # `state show` counts the run's steps by the schedule, as the loader does (it counted
        # planned batches: "30 of 42 steps served" for a state 25 steps into a 31-step epoch).
        res = shardtool_cli("state", "show", path, "--json", "--batch-size", "0:1,5:2,11:4")
        shown = json.loads(res.stdout)
        with open(path) as f:
            again = _run_from(corpus["arrow"], 1, json.load(f), **kw)[0]
        assert shown["unit"] == "steps" and shown["steps_in_epoch"] == len(again)
        assert shown["steps_in_epoch"] - shown["steps_served"] == len([units(b) for b in again])
        res = shardtool_cli("state", "show", path)
        assert "planned batches served" in res.stdout and "--batch-size 0:4,2000:8" in res.stdout
    # A resume after the skip keeps it (recorded in the state), with the same steps as the skip run.
    again = _run_from(corpus["arrow"], world, mid, **kw)
    whole = _run_from(corpus["arrow"], world, state, **kw)
    for ld in whole:
        ld.skip_steps(9, 13)
    for a, w in zip(again, whole):
        want = [units(b) for b in w][5:]
        assert [units(b) for b in a] == want


def test_a_state_of_another_base_size_is_refused(corpus):
    ld = ShardedLoader(corpus["arrow"], batch_size={0: 2, 4: 4}, num_workers=0)
    next(iter(ld))
    other = ShardedLoader(corpus["arrow"], batch_size={0: 3, 4: 6}, num_workers=0)
    with pytest.raises(Exception, match="batching"):
        other.load_state_dict(ld.state_dict())


@pytest.mark.timeout(400)
def test_torchrun_ramp_resumed_after_a_kill_matches_the_uninterrupted_run(corpus, tmp_path):
    saved, runs = killed_and_resumed(corpus["arrow"], str(tmp_path))
    assert 1 <= saved["steps"] <= 8  # rank 1 killed with SIGKILL at step 8
    for whole, resumed in runs:
        assert resumed["len"] == whole["len"]
        start = saved["steps"]
        assert sorted(map(int, resumed["steps"])) == list(range(start, whole["len"]))
        assert all(resumed["steps"][str(s)] == whole["steps"][str(s)] for s in range(start, whole["len"]))
        sizes = [len(whole["steps"][str(s)]) for s in range(whole["len"] - 1)]
        assert sizes == [4] * 10 + [8] * (whole["len"] - 11)  # the ramp, at the same step on every rank


def test_schedule_cut_property():
    @settings(max_examples=300, deadline=None)
    @given(
        sizes=st.lists(st.integers(1, 12), min_size=1, max_size=4),
        gaps=st.lists(st.integers(1, 20), min_size=3, max_size=3),
        first=st.integers(0, 80),
        count=st.integers(0, 200),
        split=st.integers(0, 60),
    )
    def check(sizes, gaps, first, count, split):
        changes = changes_of(sizes, gaps)
        s = parse_schedule("batch_size", changes)
        cut = s.cut(first, count)
        assert cut[0] == 0 and cut[-1] == count and (np.diff(cut) > 0).all()
        steps = np.diff(cut)
        for j, k in enumerate(steps[:-1]):
            assert k * s.base == s.size_at(first + j)
        if steps.size:
            assert steps[-1] * s.base <= s.size_at(first + steps.size - 1)
        # Resuming at any step boundary cuts the rest as the whole did.
        j = min(split, steps.size)
        assert np.array_equal(cut[j] + s.cut(first + j, count - int(cut[j])), cut[j:])

    check()


def test_shardtool_plan_shows_the_schedules_steps(corpus):
    """`shardtool plan --batch-size 0:2,5:4,12:8` says the epoch's steps by size as the loader takes them."""
    res = shardtool_cli("plan", corpus["arrow"], "--batch-size", "0:2,5:4,12:8", "--epoch", "1", "--json")
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)["schedule"]
    ld = ShardedLoader(corpus["arrow"], batch_size=RAMP, num_workers=0)
    n0 = len(ld)
    ld.set_epoch(1)
    assert got["epoch_first_step"] == n0 and got["steps"] == len(ld)
    assert [(p["size"], p["steps"]) for p in got["phases"]] == [(8, len(ld))]
    # Each phase's tokens are those its planned batches hold, on every rank (they were the
    # phase's share of samples times the mean length: 464,761 for 84,098 to 403,787 by seed).
    for seed in (0, 3):
        got = json.loads(
            shardtool_cli(
                "plan",
                corpus["arrow"],
                "--batch-size",
                "0:2,5:4,12:8",
                "--ranks-per-node",
                "2",
                "--seed",
                str(seed),
                "--json",
            ).stdout
        )["schedule"]
        served = [0, 0, 0]
        for r in range(2):
            for step, b in enumerate(
                ShardedLoader(corpus["arrow"], batch_size=RAMP, num_workers=0, seed=seed, rank=r, world_size=2)
            ):
                served[(step >= 5) + (step >= 12)] += int(b["lengths"].sum())
        assert [p["tokens"] for p in got["phases"]] == served
    text = shardtool_cli("plan", corpus["arrow"], "--batch-size", "0:2,5:4,12:8")
    assert text.returncode == 0 and "steps 0..4: size 2 x 5 steps" in text.stdout, text.stdout
    assert "steps 5..11: size 4 x 7 steps" in text.stdout
    bad = shardtool_cli("plan", corpus["arrow"], "--batch-size", "5:2")
    assert bad.returncode != 0 and "from step 0" in bad.stderr
    budget = shardtool_cli("plan", corpus["arrow"], "--max-tokens", "0:65536,5:100000")
    assert budget.returncode == 2 and "not a multiple of the smallest budget 65536" in budget.stderr, budget.stderr
    found = shardtool_cli("trace", corpus["arrow"], "--batch-size", "0:2,5:4", "--key", "000000001", "--json")
    assert found.returncode == 0, found.stderr
    ld = ShardedLoader(corpus["arrow"], batch_size={0: 2, 5: 4}, num_workers=0)
    assert json.loads(found.stdout)["served"] == find(ld, sample_of(ld, key="000000001"))


def _served(batch, packed: bool) -> list[tuple]:
    """What a step's batch holds, by its own fields: keys; packed, (row, key, offset in its document)."""
    if not packed:
        return [(str(k),) for k in batch["__key__"]]
    return packed_pieces(batch)


def _step_traced(t: dict, packed: bool) -> list[tuple]:
    return [(s["row"], s["key"], s["offset"]) if packed else (s["key"],) for s in t["samples"]]


SCHEDULED = {"bucketed": dict(batch_size=RAMP), "packed": dict(batch_size=RAMP, seq_len=256, packing="best-fit")}


def _one_rank(corpus, rank: int, world: int, kind: str) -> ShardedLoader:
    """Rank ``rank`` of ``world``'s loader of the ``kind`` of ramp, another process's view."""
    return ShardedLoader(
        corpus["arrow"], rank=rank, world_size=world, ranks_per_node=world, num_workers=0, seed=7, **SCHEDULED[kind]
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", sorted(SCHEDULED))
@pytest.mark.parametrize("world", [1, 3])
def test_a_scheduled_steps_trace_is_the_step_served(corpus, kind, world):
    """Issue 36: ``trace`` answers for the steps of a ramp: step t's samples (rows numbered across
    the planned batches it joins) are those the loader serves at step t, in epoch 0 and in epoch
    1 (whose steps continue from epoch 0's), and after a resume mid-epoch with steps skipped."""
    packed = kind == "packed"
    for ld in _ranks(corpus["arrow"], world, seed=7, **SCHEDULED[kind]):
        fresh = _one_rank(corpus, ld.rank, world, kind)
        for epoch in (0, 1):
            ld.set_epoch(epoch)
            got = [_served(b, packed) for b in ld]
            for step in range(len(got)):
                t = trace(fresh, step, epoch=epoch)
                assert _step_traced(t, packed) == got[step], (kind, ld.rank, epoch, step)
            with pytest.raises(ValueError, match="past epoch"):
                trace(fresh, len(got), epoch=epoch)
        # A run rolled back to step 4 of epoch 0 and told to skip steps 6..8: traced as it runs.
        ld.set_epoch(0)
        it = iter(ld)
        for _ in range(4):
            next(it)
        state = ld.state_dict()
        it.close()
        again = _one_rank(corpus, ld.rank, world, kind)
        again.load_state_dict(state)
        again.skip_steps(6, 9)
        traced = [_step_traced(trace(again, step), packed) for step in range(4, len(again))]
        assert traced == [_served(b, packed) for b in again], (kind, ld.rank)
        ld.close()
        fresh.close()
        again.close()


@pytest.mark.timeout(300)
def test_the_cli_traces_and_dumps_a_scheduled_step(corpus, tmp_path):
    url, kw = corpus["arrow"], dict(batch_size=RAMP, seq_len=256, seed=2, rank=1, world_size=2, ranks_per_node=2)
    ld = ShardedLoader(url, num_workers=0, **kw)
    delivered = [b for _, b in zip(range(9), ld)]
    want = trace(ld, 6, epoch=0)
    args = ["trace", url, "--step", "6", "--rank", "1", "--ranks-per-node", "2", "--seq-len", "256"]
    args += ["--batch-size", "0:2,5:4,12:8", "--seed", "2"]
    out = shardtool_cli(*args, "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == want
    assert len({s["row"] for s in want["samples"]}) == 4  # step 6 is of size 4: two planned batches of 2 rows
    ld.close()
    again = ShardedLoader(url, num_workers=0, **kw)
    written = dump(again, 3, 7, str(tmp_path / "d"))
    assert len(written) == 8
    for step in range(3, 7):
        arrays = np.load(tmp_path / "d" / f"step-{step:08d}.rank-1.npz")
        for name in ("input_ids", "cu_seqlens", "doc_offsets"):
            assert np.array_equal(arrays[name], delivered[step][name].numpy()), (step, name)
    again.close()
