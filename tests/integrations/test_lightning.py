"""ShardedLoader inside PyTorch Lightning: exact mid-epoch resume from Lightning's own checkpoint,
under DDP (2 processes, gloo, Lightning's own launcher) and in one process.

The DDP runs use ``strategy="ddp"`` through examples/train_lightning.py, launched with subprocess:
that is what users run (Lightning starts rank 1 by re-running the script), the batches each rank
trains on are written to per-rank files, and a preemption is a real process exit. ``ddp_spawn``
would pickle the loader into the workers and is not what the example does.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardtool.loader import ShardedLoader
from test_loader_data import write_dataset

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "train_lightning.py"
BATCH = 4


def _records(log_dir: Path, rank: int, kind: str = "train") -> list[dict]:
    with open(log_dir / f"batches.rank{rank}.jsonl") as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


def _by_step(records: list[dict]) -> dict[int, tuple]:
    """Training batches by global step (steps done before the batch): epoch, index, keys, token hash."""
    return {r["step"]: (r["epoch"], r["batch_idx"], r["keys"], r["hash"]) for r in records}


def _plain_epochs(root: str, epochs: int, batch: int = BATCH, **layout) -> list[list[list[str]]]:
    """The batches a plain ShardedLoader of that layout yields per epoch: what Lightning must train on."""
    out = []
    for e in range(epochs):
        ld = ShardedLoader(root, batch_size=batch, num_workers=0, **layout)
        ld.set_epoch(e)
        out.append([list(b["__key__"]) for b in ld])
        ld.close()
    return out


# ---------------------------------------------------------------------------------------- DDP
def _run_example(args: list[str], *, expect: int = 0, devices: int = 2, batch: int = BATCH) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cp = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            "--devices",
            str(devices),
            "--accelerator",
            "cpu",
            "--batch-size",
            str(batch),
            "--num-workers",
            "0",
            *args,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert cp.returncode == expect, f"exit {cp.returncode}\n{cp.stdout[-3000:]}\n{cp.stderr[-6000:]}"
    return cp.stdout + cp.stderr


def _preempted(data: list[str], tmp_path: Path, *, every: int, step: int, batch: int = BATCH) -> None:
    """Run B: logs to B/, checkpoints every ``every`` steps into ck/, every rank exits after ``step``."""
    _run_example(
        [*data, "--log-dir", str(tmp_path / "B"), "--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every", str(every)]
        + ["--preempt-at-step", str(step)],
        expect=3,
        batch=batch,
    )


@pytest.mark.timeout(240)
def test_ddp_resume_from_lightning_checkpoint_mid_epoch_trains_the_same_batches(tmp_path):
    root, keys = write_dataset(str(tmp_path / "train"), [40, 40, 40])
    val, val_keys = write_dataset(str(tmp_path / "val"), [10, 9], seed=1, prefix="v")
    data = ["--data", root, "--val-data", val, "--epochs", "2"]  # OneCycleLR schedule: the #20550 path

    # A: uninterrupted, 2 epochs. B: checkpoints every 5 steps, preempted (every rank exits) after
    # step 7, inside epoch 0. C: resumes from B's step-5 checkpoint with trainer.fit(ckpt_path=...).
    _run_example([*data, "--log-dir", str(tmp_path / "A")])
    _preempted(data, tmp_path, every=5, step=7)
    out = _run_example([*data, "--log-dir", str(tmp_path / "C"), "--resume", str(tmp_path / "ck" / "step-step=5.ckpt")])
    assert "#20550" in out  # Lightning skipped the restore here; the callback did it

    # Each rank is its own DP rank, from the process group: its batches are a plain loader's for
    # that rank of 2 on one node, epoch by epoch (no DistributedSampler, no other split).
    a = {r: _records(tmp_path / "A", r) for r in (0, 1)}
    for r in (0, 1):
        want = _plain_epochs(root, 2, rank=r, world_size=2, ranks_per_node=2)
        assert [[x["keys"] for x in a[r] if x["epoch"] == e] for e in (0, 1)] == want
    n = len(want[0])
    assert n == 15 and [len(a[r]) for r in (0, 1)] == [2 * n, 2 * n]
    for e in (0, 1):  # no sample goes to two ranks; with 120 = 2 x 15 x 4 none is left out
        served = [k for r in (0, 1) for x in a[r] if x["epoch"] == e for k in x["keys"]]
        assert sorted(served) == sorted(keys)

    for r in (0, 1):
        b, c, whole = _by_step(_records(tmp_path / "B", r)), _by_step(_records(tmp_path / "C", r)), _by_step(a[r])
        assert b == {s: whole[s] for s in range(7)}  # the preempted run trained on A's batches up to there
        # the resumed run: steps 5.. (batch 5 of epoch 0 onwards), across the epoch boundary, each
        # batch A's at that step on that rank: same keys, same tokens, same epoch and index
        assert sorted(c) == list(range(5, 2 * n)) and c == {s: whole[s] for s in range(5, 2 * n)}
        assert c[n - 1][:2] == (0, n - 1) and c[n][:2] == (1, 0)

    # Validation (shuffle=False, drop_last=False) at each epoch end: every sample once per run,
    # split over the ranks, the same batches in the resumed run as in the uninterrupted one.
    for run in ("A", "C"):
        for e in (0, 1):
            got = [k for r in (0, 1) for x in _records(tmp_path / run, r, "val") if x["epoch"] == e for k in x["keys"]]
            assert sorted(got) == sorted(val_keys)
    assert [_records(tmp_path / "C", r, "val") for r in (0, 1)] == [_records(tmp_path / "A", r, "val") for r in (0, 1)]

    # D: the same checkpoint resumed on ONE device (elastic). The rest of epoch 0 is the 2 ranks'
    # unserved batches re-dealt to the one rank (what ShardedLoader.load_state_dict gives), epoch 1
    # a whole 1-rank epoch: Lightning's epoch lengths follow (5 + 20 batches, then 30). A constant
    # LR: a schedule sized by estimated_stepping_batches for 2 devices cannot run 55 steps.
    _run_example(
        [
            *data,
            "--no-schedule",
            "--log-dir",
            str(tmp_path / "D"),
            "--resume",
            str(tmp_path / "ck" / "step-step=5.ckpt"),
        ],
        devices=1,
    )
    import torch

    ckpt = torch.load(tmp_path / "ck" / "step-step=5.ckpt", map_location="cpu", weights_only=False)
    rest = ShardedLoader(root, batch_size=BATCH, num_workers=0)
    rest.load_state_dict(ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"][0])
    want_d = [[list(b["__key__"]) for b in rest]] + _plain_epochs(root, 2)[1:]
    d = _records(tmp_path / "D", 0)
    assert [len(w) for w in want_d] == [20, 30]
    assert [[x["keys"] for x in d if x["epoch"] == e] for e in (0, 1)] == want_d
    assert [x["step"] for x in d] == list(range(5, 55)) and [x["batch_idx"] for x in d][:21] == [*range(5, 25), 0]


@pytest.mark.timeout(420)
def test_ddp_a_bare_sharded_loader_resumed_mid_epoch_trains_every_epoch_exactly(tmp_path):
    """Issue 32's case: train_dataloader() returns the ShardedLoader itself; 2 ranks, batch 8, 110
    batches an epoch, a checkpoint every 25 steps, killed after step 60, resumed from step 50.
    Before, len() was the epoch's rest while Lightning counted from batch 50: epoch 0 ended after
    10 batches and "epoch 1" was epoch 0's batches 60-109; with a schedule (#20550) epoch 0 was
    replayed from batch 0. Now both resume at batch 50 and train epoch 1 whole."""
    root, keys = write_dataset(str(tmp_path / "train"), [440] * 4)
    batch, n = 8, 110
    data = ["--data", root, "--epochs", "2", "--bare"]
    _preempted(data, tmp_path, every=25, step=60, batch=batch)
    ckpt = str(tmp_path / "ck" / "step-step=50.ckpt")
    want = {r: _plain_epochs(root, 2, batch, rank=r, world_size=2, ranks_per_node=2) for r in (0, 1)}
    assert [len(w) for w in want[0]] == [n, n]
    for run, flags in (("plain", ["--no-schedule", "--no-callback"]), ("schedule", [])):
        _run_example([*data, *flags, "--log-dir", str(tmp_path / run), "--resume", ckpt], batch=batch)
        for r in (0, 1):
            got = _by_step(_records(tmp_path / run, r))
            assert sorted(got) == list(range(50, 2 * n)), run  # the run ends at step 220, not 110 or 160
            for s, (epoch, idx, k, _) in got.items():
                assert (epoch, idx) == divmod(s, n) and k == want[r][epoch][idx], (run, r, s)


# ------------------------------------------------------------------------------ one process
def _example():
    spec = importlib.util.spec_from_file_location("train_lightning_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Stop:
    """Stops the fit after step ``step`` (a graceful stand-in for a preemption, in this process)."""

    def __new__(cls, step: int):
        import lightning as L

        class Stop(L.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                if trainer.global_step >= step:
                    trainer.should_stop = True

        return Stop()


def _fit(
    ex,
    root: str,
    log_dir: Path,
    *,
    schedule: bool = True,
    callback: bool = True,
    ckpt_dir: Path | None = None,
    every: int = 5,
    stop: int | None = None,
    resume: Path | None = None,
    epochs: int = 2,
    val: str | None = None,
    bare: bool = False,
):
    """One fit of the example's module and data; ``val``: validate every ``every`` steps and
    checkpoint at each validation's end (monitor="val_loss") instead of every ``every`` steps."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from shardtool.integrations.lightning import ShardedLoaderCallback

    args = ex.parse_args(
        ["--data", root, "--batch-size", str(BATCH), "--num-workers", "0"]
        + (["--val-data", val] if val else [])
        + (["--bare"] if bare else [])
    )
    callbacks = [ShardedLoaderCallback()] if callback else []
    if stop is not None:
        callbacks.append(_Stop(stop))
    if ckpt_dir is not None:
        when = dict(monitor="val_loss") if val else dict(every_n_train_steps=every)
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, filename="step-{step}", save_top_k=-1, **when))
    L.seed_everything(0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        callbacks=callbacks,
        logger=False,
        limit_val_batches=1.0 if val else 0,
        val_check_interval=every if val else 1.0,
        enable_checkpointing=ckpt_dir is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(log_dir),
    )
    trainer.fit(
        ex.TinyLM(schedule=schedule, log_dir=str(log_dir)),
        datamodule=ex.ShardedData(args),
        ckpt_path=str(resume) if resume else None,
    )
    return _by_step(_records(log_dir, 0)), trainer


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """A dataset, the example module, the uninterrupted run and checkpoints of a run stopped at step 9."""
    tmp = tmp_path_factory.mktemp("lightning1")
    root, _ = write_dataset(str(tmp / "d"), [30, 30])
    ex = _example()
    whole, _ = _fit(ex, root, tmp / "A")
    _fit(ex, root, tmp / "B", ckpt_dir=tmp / "ck", stop=9)
    return ex, root, whole, tmp


@pytest.mark.timeout(120)
def test_lightning_20550_estimated_stepping_batches_skips_the_restore_and_the_callback_fixes_it(one_process, caplog):
    ex, root, whole, tmp = one_process
    n = 15
    assert sorted(whole) == list(range(2 * n))
    ckpt = tmp / "ck" / "step-step=5.ckpt"
    # Without the callback, configure_optimizers reading trainer.estimated_stepping_batches makes
    # Lightning build the loader before it reads the checkpoint, and it never restores the loader:
    # the resumed run trains on epoch 0's first batches again while Lightning counts step 5 on.
    # (Should Lightning fix #20550, this fails: then the callback is only a check.)
    broken, _ = _fit(ex, root, tmp / "no-callback", callback=False, resume=ckpt)
    assert broken[5][2] == whole[0][2] and broken[5][2] != whole[5][2]
    # With it: exactly the uninterrupted run's batches from step 5 on, over the epoch boundary.
    with caplog.at_level(logging.WARNING, logger="shardtool.integrations.lightning"):
        fixed, trainer = _fit(ex, root, tmp / "callback", resume=ckpt)
    assert fixed == {s: whole[s] for s in range(5, 2 * n)} and trainer.global_step == 2 * n
    assert "#20550" in caplog.text


@pytest.mark.timeout(120)
def test_without_a_schedule_lightning_restores_the_loader_itself(one_process, caplog):
    ex, root, _, tmp = one_process
    whole, _ = _fit(ex, root, tmp / "A-const", schedule=False)
    _fit(ex, root, tmp / "B-const", schedule=False, ckpt_dir=tmp / "ck-const", stop=9)
    with caplog.at_level(logging.WARNING, logger="shardtool.integrations.lightning"):
        resumed, _ = _fit(
            ex, root, tmp / "C-const", schedule=False, callback=False, resume=tmp / "ck-const" / "step-step=5.ckpt"
        )
    assert resumed == {s: whole[s] for s in range(5, 30)}
    assert "#20550" not in caplog.text


@pytest.mark.timeout(120)
def test_checkpoint_on_the_last_batch_of_an_epoch_resumes_at_the_next_epoch(one_process):
    ex, root, whole, tmp = one_process
    _fit(ex, root, tmp / "B-end", ckpt_dir=tmp / "ck-end", every=15, stop=15)
    resumed, trainer = _fit(ex, root, tmp / "C-end", resume=tmp / "ck-end" / "step-step=15.ckpt")
    assert resumed == {s: whole[s] for s in range(15, 30)} and resumed[15][:2] == (1, 0)


@pytest.mark.timeout(120)
def test_checkpoint_at_a_mid_epoch_validation_resumes_at_the_next_batch(one_process):
    """ModelCheckpoint(monitor=...) saves at the end of a validation run inside the epoch: the
    resumed run trains on the next batch and does not repeat that validation."""
    ex, root, _, tmp = one_process
    val, _ = write_dataset(str(tmp / "v"), [10, 9], seed=1, prefix="v")
    whole, _ = _fit(ex, root, tmp / "A-val", val=val, every=10)
    _fit(ex, root, tmp / "B-val", val=val, every=10, ckpt_dir=tmp / "ck-val", stop=12)
    resumed, _ = _fit(ex, root, tmp / "C-val", val=val, every=10, resume=tmp / "ck-val" / "step-step=10.ckpt")
    assert resumed == {s: whole[s] for s in range(10, 30)}
    runs = [[x["keys"] for x in _records(tmp / d, 0, "val")] for d in ("A-val", "C-val")]
    assert len(runs[0]) == 2 * 5 and runs[1] == runs[0][5:]  # 5 batches at batch 10 of each epoch; the first was done


@pytest.mark.timeout(120)
def test_the_callback_refuses_a_loader_that_is_not_at_lightnings_step(one_process):
    """A loader positioned by hand (here: a state loaded before a fresh fit) disagrees with
    Lightning's step: the first batch fails, before the model trains on it."""
    import lightning as L

    from shardtool.integrations.lightning import LightningLoader, ShardedLoaderCallback
    from shardtool.loader import LoaderError

    ex, root, _, tmp = one_process
    ahead = ShardedLoader(root, batch_size=BATCH, num_workers=0)
    for _, _ in zip(range(5), ahead):
        pass
    data = ex.ShardedData(ex.parse_args(["--data", root, "--batch-size", str(BATCH), "--num-workers", "0"]))
    loader = ShardedLoader(root, batch_size=BATCH, num_workers=0)
    loader.load_state_dict(ahead.state_dict())
    data.train = LightningLoader(loader)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        callbacks=[ShardedLoaderCallback()],
        logger=False,
        limit_val_batches=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp / "ahead"),
    )
    with pytest.raises(LoaderError, match="at epoch 0, batch 6, but Lightning is at epoch 0, batch 1"):
        trainer.fit(ex.TinyLM(), datamodule=data)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", [False, True], ids=["constant-lr", "schedule"])
def test_a_bare_sharded_loader_resumed_mid_epoch_trains_the_same_batches(one_process, schedule, caplog):
    """train_dataloader() returns the ShardedLoader itself: len() is the whole epoch, as Lightning
    counts, and iter() decides the pass at the first batch, after Lightning restored the state.
    With a schedule (#20550) the callback restores it, as it does a LightningLoader."""
    ex, root, whole, tmp = one_process
    ckpt = tmp / "ck" / "step-step=5.ckpt"
    with caplog.at_level(logging.WARNING, logger="shardtool.integrations.lightning"):
        got, trainer = _fit(
            ex, root, tmp / f"bare-{schedule}", schedule=schedule, callback=schedule, resume=ckpt, bare=True
        )
    assert got == {s: whole[s] for s in range(5, 30)} and trainer.global_step == 30
    assert ("#20550" in caplog.text) == schedule


@pytest.mark.timeout(60)
def test_a_loader_built_for_another_rank_than_lightnings_fails_at_its_first_batch(tmp_path):
    """Built before trainer.fit, a loader cannot know its rank; under the process group it is
    refused at the first batch, naming the fix, instead of serving another rank's data."""
    import torch.distributed as dist

    from shardtool.integrations.lightning import LightningLoader
    from shardtool.loader import LoaderError

    root, _ = write_dataset(str(tmp_path / "d"), [20])
    view = LightningLoader(ShardedLoader(root, batch_size=BATCH, num_workers=0, rank=1, world_size=2))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(LoaderError, match="built for rank 1 of 2, but Lightning runs it on rank 0 of 1"):
            next(iter(view))
    finally:
        dist.destroy_process_group()
        view.close()
