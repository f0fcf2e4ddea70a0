"""Token-budget ramps (issue 36 item 1): ``max_tokens={first step: budget}``.

The plan is made at the smallest budget and step t is the list of the next
``max_tokens(t) / smallest`` planned batches, each padded on its own: so every micro-batch holds
at most the smallest budget, a step at most its own, the samples over an epoch are those of the
run at the smallest budget in order, every rank takes as many micro-batches at every step, and a
state saved before, at or after a change resumes the uninterrupted run. Real data: stdlib files
and /usr/share/doc files of at most 4 KiB (as byte ids), so the smallest budget holds any one.
"""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.realtext import byte_ids, doc_files, stdlib_files
from helpers.runcli import shardtool_cli
from helpers.schedrun import RESUME_DRAWS, changes_of, killed_and_resumed, state_after
from helpers.skips import require
from shardtool.loader import Mixture, ShardedLoader
from shardtool.loader.trace import trace
from shardtool.plan.schedule import budget_schedule

SMALLEST = 4096


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    import shardtool

    paths = [p for p in stdlib_files(600) if 0 < os.path.getsize(p) <= SMALLEST][:260]
    paths += [p for p in doc_files() if 0 < os.path.getsize(p) <= SMALLEST][:140]
    require(len(paths) >= 200, "too few small stdlib or /usr/share/doc files here")
    rows = [{"tokens": byte_ids(p)} for p in paths]
    root = str(tmp_path_factory.mktemp("budget") / "ds")
    shardtool.pack(rows, root, format="arrow", length="tokens", shard_size=sum(r["tokens"].nbytes for r in rows) // 3)
    return root


def _ranks(url, world, **kw):
    kw.setdefault("num_workers", 0)
    return [
        ShardedLoader(url, rank=r, world_size=world, ranks_per_node=world, pin_memory=False, **kw) for r in range(world)
    ]


def _keys(step) -> list[list[str]]:
    return [list(mb["__key__"]) for mb in step]


def _padded(mb) -> int:
    return int(mb["lengths"].max()) * len(mb["lengths"])


RAMP = {0: SMALLEST, 4: 4 * SMALLEST, 9: 2 * SMALLEST}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,workers", [(1, 0), (3, 0), (2, 2)])
def test_a_budget_ramp_serves_the_smallest_budgets_batches_as_micro_batches(url, world, workers):
    base = _ranks(url, world, max_tokens=SMALLEST, seed=3)
    ramp = _ranks(url, world, max_tokens=RAMP, seed=3, num_workers=workers)
    schedule = budget_schedule(RAMP)
    counts = {len(ld) for ld in ramp}
    assert len(counts) == 1  # equal counts: every rank takes the same steps
    n = counts.pop()
    shapes = set()
    for b, r in zip(base, ramp):
        planned = [list(x["__key__"]) for x in b]
        steps = list(r)
        assert len(steps) == n and n < len(planned)
        micro = [len(s) for s in steps]
        assert micro[:-1] == [schedule.size_at(t) // SMALLEST for t in range(n - 1)]
        assert 1 <= micro[-1] <= schedule.size_at(n - 1) // SMALLEST  # the epoch's last step may be short
        shapes.add(tuple(micro))
        # The micro-batches, in order, are the run's at the smallest budget: nothing lost or repeated.
        assert [k for s in steps for k in _keys(s)] == planned
        for t, s in enumerate(steps):  # each padded on its own, within the smallest budget
            assert all(_padded(mb) <= SMALLEST for mb in s)
            assert sum(_padded(mb) for mb in s) <= schedule.size_at(t)
        b.close()
        r.close()
    assert len(shapes) == 1  # every rank: as many micro-batches at every step (DDP accumulates alike)


@pytest.mark.timeout(600)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    factors=st.lists(st.sampled_from([1, 2, 4, 8]), min_size=2, max_size=4),  # multiples of the smallest
    **RESUME_DRAWS,
)
def test_a_resume_before_at_or_after_a_budget_change_continues_the_run(
    url, factors, gaps, world, world_after, workers, stop, seed
):
    changes = changes_of([f * SMALLEST for f in factors], gaps)
    kw = dict(max_tokens=changes, seed=seed)
    whole = [[_keys(s) for s in ld] for ld in _ranks(url, world, **kw)]
    n = len(whole[0])
    stop = min(stop, n - 1)  # (after the last step the state is the next epoch's start)
    state = state_after(_ranks(url, world, **kw), stop)
    resumed = _ranks(url, world_after, num_workers=workers, **kw)
    for ld in resumed:
        ld.load_state_dict(state)
    if world_after == world:  # the same layout: the uninterrupted run's steps, exactly
        assert [[_keys(s) for s in ld] for ld in resumed] == [w[stop:] for w in whole]
        return
    # Another layout: the rest of the epoch re-dealt; nothing repeated, equal counts, the
    # schedule's micro-batches a step from the resumed step on.
    leftover = resumed[0].plan.leftover_batches  # (read before the pass: after it, the next epoch's)
    assert len({len(ld) for ld in resumed}) == 1
    rest = [[_keys(s) for s in ld] for ld in resumed]
    served = [k for w in whole for s in w[:stop] for mb in s for k in mb]
    served += [k for r in rest for s in r for mb in s for k in mb]
    assert len(served) == len(set(served))
    every = {k for w in whole for s in w for mb in s for k in mb}
    missing = every - set(served)  # only what the re-deal left over: whole planned batches
    largest = max(len(mb) for w in whole for s in w for mb in s)
    assert len(missing) <= leftover * world_after * largest
    schedule = budget_schedule(changes)  # planned at the smallest budget of the schedule
    for t, s in enumerate(rest[0][:-1], start=stop):
        assert len(s) == schedule.size_at(t) // schedule.base


@pytest.mark.timeout(300)
def test_skipping_steps_of_a_budget_ramp_moves_the_data_past_them(url):
    whole = [_keys(s) for s in _ranks(url, 1, max_tokens=RAMP, seed=1)[0]]
    ld = _ranks(url, 1, max_tokens=RAMP, seed=1)[0]
    it = iter(ld)
    for _ in range(3):
        next(it)
    state = ld.state_dict()
    again = _ranks(url, 1, max_tokens=RAMP, seed=1)[0]
    again.load_state_dict(state)
    again.skip_steps(5, 7)  # steps 5 and 6: 4 micro-batches each
    rest = [_keys(s) for s in again]
    planned = [mb for s in whole for mb in s]
    # Steps 3 and 4 as before; the steps go on counting (step 5 has 4 micro-batches) and take the
    # planned batches after those of the skipped steps.
    assert rest[:2] == whole[3:5]
    skipped = planned[1 + 1 + 1 + 1 + 4 : 1 + 1 + 1 + 1 + 4 + 8]  # steps 0..3 one each, step 4 four
    after = [mb for s in rest[2:] for mb in s]
    assert after == planned[1 + 1 + 1 + 1 + 4 + 8 :]
    assert all(mb not in after for mb in skipped)
    assert [len(s) for s in rest[2:4]] == [4, 4]


@pytest.mark.timeout(300)
def test_trace_and_plan_answer_for_a_budget_ramps_steps(url, tmp_path):
    ld = _ranks(url, 1, max_tokens=RAMP, seed=2)[0]
    steps = [_keys(s) for s in ld]
    ld = _ranks(url, 1, max_tokens=RAMP, seed=2)[0]
    for t in (0, 5, 9):  # the step's samples: those of its micro-batches, in order, each naming its micro-batch
        got = trace(ld, t)["samples"]
        assert [(s["micro_batch"], s["key"]) for s in got] == [(i, k) for i, mb in enumerate(steps[t]) for k in mb]
    text = shardtool_cli("plan", url, "--max-tokens", "0:4096,4:16384,9:8192", "--seed", "2")
    assert text.returncode == 0, text.stderr
    assert "max_tokens by step 0: 4096, 4: 16384, 9: 8192" in text.stdout
    assert "steps 0..3: max_tokens 4096 x 4 steps" in text.stdout
    assert "steps 4..8: max_tokens 16384 x 5 steps" in text.stdout
    assert f"steps 9..{len(steps) - 1}: max_tokens 8192" in text.stdout
    cli = shardtool_cli("trace", url, "--max-tokens", "0:4096,4:16384,9:8192", "--seed", "2", "--step", "5", "--json")
    assert cli.returncode == 0, cli.stderr
    assert [s["key"] for s in json.loads(cli.stdout)["samples"]] == [k for mb in steps[5] for k in mb]
    state = tmp_path / "state.json"
    state.write_text(json.dumps(ld.state_dict()))
    edit = shardtool_cli("state", "skip", str(state), "--steps", "4:6", "--max-tokens", "0:4096,4:16384,9:8192")
    assert edit.returncode == 0, edit.stderr
    again = _ranks(url, 1, max_tokens=RAMP, seed=2)[0]
    again.load_state_dict(json.loads(state.read_text()))
    assert [_keys(s) for s in again][:6] == steps[:4] + steps[6:8]  # steps 4, 5 dropped, counting on
    bad = shardtool_cli("plan", url, "--max-tokens", "0:4096,4:6000")
    assert bad.returncode == 2 and "not a multiple of the smallest budget 4096" in bad.stderr, bad.stderr


def test_a_budget_ramp_is_refused_where_it_cannot_work(url):
    for kw, words in [
        (dict(max_tokens={0: 4096, 10: 6000}), "6000 (from step 10) is not a multiple of the smallest budget 4096"),
        (dict(max_tokens={0: 4096, 10: 8192}, exact=True), "exact=True"),
        (dict(max_tokens={0: 4096, 10: 8192}, seq_len=1024), "without batch_size and seq_len"),
        (dict(max_tokens={3: 4096}), "from step 0"),
    ]:
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            ShardedLoader(url, num_workers=0, **kw)
    with pytest.raises(ValueError, match="max_tokens by step is not supported for a mixture"):
        ShardedLoader(Mixture({"a": (url, 1.0)}), max_tokens={0: 4096, 4: 8192}, steps=10, num_workers=0)
    # One budget is no schedule: the loader (and its states) are those of max_tokens=budget.
    one = ShardedLoader(url, max_tokens={0: 8192}, num_workers=0, seed=1)
    plain = ShardedLoader(url, max_tokens=8192, num_workers=0, seed=1)
    assert one.schedule is None and one.state_dict() == plain.state_dict()


@pytest.mark.timeout(400)
def test_torchrun_budget_ramp_resumed_after_a_kill_matches_the_uninterrupted_run(url, tmp_path):
    saved, runs = killed_and_resumed(url, str(tmp_path), "--budget")
    assert 1 <= saved["steps"] <= 8  # rank 1 killed with SIGKILL at step 8
    shapes = set()
    for whole, resumed in runs:
        assert resumed["len"] == whole["len"]
        start = saved["steps"]
        assert sorted(map(int, resumed["steps"])) == list(range(start, whole["len"]))
        assert all(resumed["steps"][str(s)] == whole["steps"][str(s)] for s in range(start, whole["len"]))
        micro = [len(whole["steps"][str(s)]) for s in range(whole["len"] - 1)]
        assert micro == [1] * 10 + [2] * (whole["len"] - 11)  # the ramp, at the same step on every rank
        shapes.add(tuple(micro))
    assert len(shapes) == 1


def _lightning_fit(url, root, *, max_steps: int, resume=None, every: int | None = None) -> dict[int, list]:
    """A Lightning fit of a budget ramp under manual optimization, as docs/run-changes.md says: one
    ``training_step`` a step, a backward per micro-batch. Returns each step's micro-batches' keys."""
    import lightning.pytorch as pl
    import torch

    from shardtool.integrations.lightning import LightningLoader, ShardedLoaderCallback

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.emb, self.out = torch.nn.Embedding(256, 4), torch.nn.Linear(4, 256)
            self.automatic_optimization = False
            self.seen: dict[int, list] = {}

        def training_step(self, micro, _):
            opt = self.optimizers()
            self.seen[self.global_step] = _keys(micro)
            tokens = sum(int(mb["lengths"].sum()) for mb in micro)
            for mb in micro:
                x = mb["tokens"].long()
                logits = self.out(self.emb(x[:, :-1])).flatten(0, 1)
                self.manual_backward(
                    torch.nn.functional.cross_entropy(logits, x[:, 1:].flatten(), reduction="sum") / tokens
                )
            opt.step()
            opt.zero_grad()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            return LightningLoader(ShardedLoader(url, max_tokens=RAMP, num_workers=0, seed=4, pin_memory=False))

    callbacks: list = [ShardedLoaderCallback()]
    if every is not None:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=str(root), every_n_train_steps=every, save_top_k=-1))
    model = Tiny()
    pl.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=False,
        callbacks=callbacks,
        enable_checkpointing=every is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
    ).fit(model, ckpt_path=resume)
    return model.seen


@pytest.mark.timeout(300)
def test_lightning_trains_a_budget_ramp_and_resumes_it_from_its_checkpoint(url, tmp_path):
    whole = _lightning_fit(url, tmp_path / "a", max_steps=14)
    planned = [list(b["__key__"]) for b in _ranks(url, 1, max_tokens=SMALLEST, seed=4)[0]]
    assert [len(whole[t]) for t in range(14)] == [1] * 4 + [4] * 5 + [2] * 5  # the ramp, in micro-batches
    assert [mb for t in range(14) for mb in whole[t]] == planned[: 4 + 20 + 10]
    _lightning_fit(url, tmp_path / "b", max_steps=9, every=6)
    ckpt = next((tmp_path / "b").glob("*step=6*.ckpt"))
    resumed = _lightning_fit(url, tmp_path / "c", max_steps=14, resume=str(ckpt))
    assert resumed == {t: whole[t] for t in range(6, 14)}  # from the checkpoint's step, exactly


@pytest.mark.parametrize("ramp", [dict(max_tokens=RAMP), dict(batch_size={0: 2, 4: 8, 9: 4})], ids=["budget", "rows"])
def test_a_trainers_position_in_a_scheduled_epoch_counts_steps(url, ramp):
    """What the Lightning callback checks a resume against (`position`): steps, as ``len()`` and
    the trainer count them, not the planned batches they take (the callback refused every resume
    of a ramp before)."""
    from shardtool.integrations.position import position

    ld = _ranks(url, 1, seed=0, **ramp)[0]
    n = len(ld)
    it = iter(ld)
    for k in range(1, 12):
        next(it)
        assert position(ld) == (0, k)
    for _ in it:
        pass
    assert position(ld) == (1, 0) and n > 12


@pytest.mark.timeout(300)
def test_state_skip_refuses_a_schedule_that_did_not_plan_the_state(url, tmp_path):
    """A schedule of another kind or another largest size counts other planned batches as a step:
    `shardtool state skip` with it dropped step 6's data where steps 7..8 were asked."""
    saved = {}
    for name, kw in (("budget", dict(max_tokens={0: 4096, 5: 16384})), ("rows", dict(batch_size={0: 4, 5: 8}))):
        ld = _ranks(url, 1, seed=0, **kw)[0]
        it = iter(ld)
        for _ in range(6):
            next(it)
        saved[name] = tmp_path / f"{name}.json"
        saved[name].write_text(json.dumps(ld.state_dict()))
    for name, flags, words in [
        ("budget", ["--batch-size", "0:4,5:8"], "planned at max_tokens 4096"),
        ("budget", ["--seq-len", "0:512,5:2048", "--batch-size", "4"], "planned at max_tokens 4096"),
        ("rows", ["--max-tokens", "0:4096,5:16384"], "planned at batch_size 4"),
        ("rows", ["--batch-size", "0:4,5:12"], "in runs of 8 batches (a batch-size ramp whose largest size is 8)"),
    ]:
        out = shardtool_cli("state", "skip", str(saved[name]), "--steps", "7:9", *flags, "-o", str(tmp_path / "x.json"))
        assert out.returncode == 1 and words in out.stderr, (flags, out.stderr)
        assert not (tmp_path / "x.json").exists()
    for name, flags in (("budget", ["--max-tokens", "0:4096,5:16384"]), ("rows", ["--batch-size", "0:4,5:8"])):
        ok = shardtool_cli("state", "skip", str(saved[name]), "--steps", "7:9", *flags, "-o", str(tmp_path / "ok.json"))
        assert ok.returncode == 0, ok.stderr
