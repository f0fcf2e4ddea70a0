"""Skipping steps after a loss spike (issue 36 item 3, issue 35's workflow): roll back to a
checkpoint, skip the steps whose data is suspect, resume. The steps go on counting and the data
moves past them: step A gets the batch of step B, and the epoch has B - A fewer steps, on every
rank alike. The skip is recorded in the state (a later resume keeps it; `trace` answers for the
run as it went); `shardtool state skip` does the same to a saved state.

Real data: stdlib files as byte ids (long documents) and short /usr/share/doc files."""

from __future__ import annotations

import json
import os

import pytest

from helpers.realtext import pack_long_and_short
from helpers.runcli import shardtool_cli
from helpers.torchrun import torchrun
from shardtool.loader import Mixture, ShardedLoader
from shardtool.loader.trace import trace
from shardtool.plan import LoaderState


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return pack_long_and_short(str(tmp_path_factory.mktemp("skip") / "ds"), 240, 160, least=300, paths=True)


def _keys(batch) -> list:
    keys = batch["__key__"]
    return [list(k) for k in keys] if keys and isinstance(keys[0], list) else list(keys)


def _ranks(url, world, **kw):
    return [
        ShardedLoader(url, rank=r, world_size=world, ranks_per_node=world, pin_memory=False, **kw) for r in range(world)
    ]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "kw",
    [dict(batch_size=2, num_workers=0), dict(batch_size=2, seq_len=1024, num_workers=2)],
    ids=["bucketed", "packed"],
)
def test_a_rolled_back_run_skips_the_spike_steps_on_every_rank(corpus, kw):
    first = _ranks(corpus, 3, seed=4, **kw)
    n = len(first[0])
    assert n > 45
    run = [[_keys(b) for b in ld] for ld in first]  # the run that spiked, every step of every rank
    # Roll back to the checkpoint after step 30 and skip steps 35..39.
    again = _ranks(corpus, 3, seed=4, **kw)
    for ld in again:
        it = iter(ld)
        for _ in range(30):
            next(it)
    state = again[0].state_dict()
    resumed = _ranks(corpus, 3, seed=4, **kw)
    for ld in resumed:
        ld.load_state_dict(state)
        ld.skip_steps(35, 40)
    assert {len(ld) for ld in resumed} == {n - 5} and {ld.batches_left for ld in resumed} == {n - 35}
    # What a rank is asked for at step 36 is known before it is read: the trace says it.
    traced = [[s["key"] for s in trace(ld, 36)["samples"]] for ld in resumed]
    got = [[_keys(b) for b in ld] for ld in resumed]
    for r in range(3):
        assert got[r] == run[r][30:35] + run[r][40:]
        step36 = got[r][6] if "seq_len" in kw else [got[r][6]]  # packed: a list of keys per row
        assert traced[r] == [k for row in step36 for k in row]


@pytest.mark.timeout(300)
def test_the_skip_survives_a_resume_on_fewer_ranks_and_serves_the_rest_once(corpus):
    kw = dict(batch_size=3, num_workers=0, seed=2)
    every = [k for ld in _ranks(corpus, 3, **kw) for b in ld for k in b["__key__"]]
    first, served = _ranks(corpus, 3, **kw), []
    for ld in first:
        it = iter(ld)
        for _ in range(10):
            served += list(next(it)["__key__"])
    state = first[0].state_dict()
    resumed, skipped = _ranks(corpus, 3, **kw), []
    for ld in resumed:
        ld.load_state_dict(state)
        skipped += [s["key"] for step in range(12, 15) for s in trace(ld, step)["samples"]]  # what they held
        ld.skip_steps(12, 15)
        it = iter(ld)
        for _ in range(4):  # steps 10, 11, then 12 and 13: the batches steps 15 and 16 had
            served += list(next(it)["__key__"])
    saved = resumed[0].state_dict()
    assert saved["segments"][-1]["skipped"] == [[12, 15]]
    two = _ranks(corpus, 2, **kw)  # a node lost: the rest goes to 2 ranks
    for ld in two:
        ld.load_state_dict(saved)
    assert len({ld.batches_left for ld in two}) == 1
    over = two[0].planner.left_over(LoaderState.from_dict(two[0].state_dict()))  # fewer than 2 batches
    for ld in two:
        served += [k for b in ld for k in b["__key__"]]
    assert not set(served) & set(skipped) and len(skipped) == 3 * 3 * 3
    assert len(served) == len(set(served))  # nothing twice
    assert len(set(every) - set(served) - set(skipped)) == sum(b.size for b in over) and len(over) < 2


def test_state_skip_edits_a_saved_state_as_skip_steps_does(corpus, tmp_path):
    (ld,) = _ranks(corpus, 1, batch_size=4, num_workers=0)
    it = iter(ld)
    for _ in range(8):
        next(it)
    path = tmp_path / "ckpt.json"
    path.write_text(json.dumps({"step": 8, "loader": ld.state_dict()}))
    res = shardtool_cli("state", "skip", str(path), "--key", "loader", "--steps", "9:12")
    assert res.returncode == 0, res.stderr
    edited = json.loads(path.read_text())
    assert edited["step"] == 8
    (by_api,) = _ranks(corpus, 1, batch_size=4, num_workers=0)
    by_api.load_state_dict(ld.state_dict())
    by_api.skip_steps(9, 12)
    assert edited["loader"] == by_api.state_dict()
    shown = shardtool_cli("state", "show", str(path), "--key", "loader", "--json")
    assert json.loads(shown.stdout)["steps_in_epoch"] == len(by_api)
    bare = shardtool_cli("state", str(path), "--key", "loader", "--json")  # show is the default action
    assert bare.returncode == 0 and json.loads(bare.stdout) == json.loads(shown.stdout)
    bad = shardtool_cli("state", "skip", str(path), "--key", "loader", "--steps", "2:5")
    assert bad.returncode == 1 and "not yet served" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.timeout(300)
def test_state_and_trace_read_the_state_inside_a_torch_checkpoint(corpus, tmp_path):
    """The README's recipe saves the state inside a torch checkpoint (``torch.save({"model": ...,
    "loader": loader.state_dict()})``, as examples/train_ddp.py does): `state show`, `state skip`
    and `trace --state` read it there (``weights_only=True``), and never rewrite the checkpoint."""
    import torch

    (ld,) = _ranks(corpus, 1, batch_size=4, num_workers=0, seed=2)
    it = iter(ld)
    for _ in range(8):
        next(it)
    ckpt = tmp_path / "latest.pt"
    torch.save({"model": {"w": torch.ones(3)}, "step": 8, "loader": ld.state_dict()}, ckpt)
    before = ckpt.read_bytes()
    shown = shardtool_cli("state", "show", str(ckpt), "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["steps_in_epoch"] == len(ld)
    refused = shardtool_cli("state", "skip", str(ckpt), "--steps", "9:12")
    assert refused.returncode == 1 and "-o OUT.json" in refused.stderr
    out = tmp_path / "loader_state.json"
    edited = shardtool_cli("state", "skip", str(ckpt), "--steps", "9:12", "-o", str(out))
    assert edited.returncode == 0, edited.stderr
    assert ckpt.read_bytes() == before  # the checkpoint is only read
    (by_api,) = _ranks(corpus, 1, batch_size=4, num_workers=0, seed=2)
    by_api.load_state_dict(ld.state_dict())
    by_api.skip_steps(9, 12)
    assert json.loads(out.read_text()) == by_api.state_dict()
    traced = shardtool_cli("trace", corpus, "--batch-size", "4", "--seed", "2", "--state", str(ckpt), "--step", "8")
    assert traced.returncode == 0, traced.stderr
    assert f"{len(_keys(next(it)))} samples" in traced.stdout  # step 8: the batch the run served next
    # The corpus has a path field: trace of packed rows does not tell the user of a keyword it has not.
    packed = shardtool_cli("trace", corpus, "--batch-size", "2", "--seq-len", "256", "--step", "0")
    assert packed.returncode == 0 and "token_fields" not in packed.stderr, packed.stderr
    empty = shardtool_cli("state", "show")
    assert empty.returncode != 0 and "give the state file" in empty.stderr
    nothing = tmp_path / "weights.pt"
    torch.save({"model": {"w": torch.ones(3)}}, nothing)
    missing = shardtool_cli("state", "show", str(nothing))
    assert missing.returncode == 1 and "no loader state at its top ('model')" in missing.stderr


def test_skips_that_cannot_be_honoured_are_refused(corpus):
    (ld,) = _ranks(corpus, 1, batch_size=4, num_workers=0)
    with pytest.raises(ValueError, match="not yet served"):
        ld.skip_steps(5, 5)
    it = iter(ld)
    next(it)
    with pytest.raises(ValueError, match="before the pass's first batch"):
        ld.skip_steps(5, 8)
    mix = ShardedLoader(Mixture({"code": (corpus, 1.0)}), batch_size=4, steps=10, num_workers=0)
    with pytest.raises(ValueError, match="stop <= 10"):  # a mixture's steps end at its steps=
        mix.skip_steps(2, 11)
    mix.skip_steps(2, 3)
    with pytest.raises(ValueError, match="after the last skip"):
        mix.skip_steps(1, 2)


@pytest.mark.timeout(300)
def test_torchrun_three_ranks_roll_back_to_step_30_and_skip_35_to_40(corpus, tmp_path):
    out = str(tmp_path / "out")
    os.makedirs(out)

    def launch(phase: str) -> None:
        res = torchrun("skip_worker.py", 3, "--data", corpus, "--out", out, "--phase", phase, timeout=200)
        assert res.returncode == 0, res.stderr[-4000:]

    launch("first")
    launch("resumed")
    for r in range(3):
        first = json.load(open(os.path.join(out, f"first.rank{r}.json")))
        resumed = json.load(open(os.path.join(out, f"resumed.rank{r}.json")))
        n = first["len"]
        assert resumed["len"] == n - 5
        want = [first["steps"][str(s)] for s in [*range(30, 35), *range(40, n)]]
        got = [resumed["steps"][str(s)] for s in range(30, n - 5)]
        assert got == want and sorted(map(int, resumed["steps"])) == list(range(30, n - 5))
