"""ShardedLoader inside the Hugging Face Trainer and accelerate: exact mid-epoch resume from their
own checkpoints, with no batch replayed, under torchrun (2 processes, gloo) and in one process.

The DDP run launches examples/train_hf.py under ``torch.distributed.run`` with subprocess: that is
what users run, the batches each rank trains on are written to per-rank files, and a preemption is
a real process exit. The model is a randomly initialised one-layer GPT-2 (nothing downloaded).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shardtool.loader import ShardedLoader
from test_loader_data import write_dataset

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "train_hf.py"
ROWS, SEQ = 2, 32  # packed rows per batch, tokens per row


def _hash(input_ids) -> str:
    return hashlib.sha256(input_ids.cpu().numpy().tobytes()).hexdigest()[:16]


def _records(log_dir: Path, rank: int = 0) -> list[dict]:
    with open(log_dir / f"batches.rank{rank}.jsonl") as f:
        return [json.loads(line) for line in f]


def _by_step(records: list[dict]) -> dict[int, str]:
    """input_ids hash of the batch trained on at each global step (steps done before it)."""
    return {r["step"]: r["hash"] for r in records}


def _plain_epochs(root: str, epochs: int, **layout) -> list[list[str]]:
    """The batches a plain ShardedLoader of that layout yields per epoch: what the Trainer must train on."""
    out = []
    for e in range(epochs):
        ld = ShardedLoader(root, batch_size=ROWS, seq_len=SEQ, num_workers=0, **layout)
        ld.set_epoch(e)
        out.append([_hash(b["input_ids"]) for b in ld])
        ld.close()
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------- DDP
def _torchrun(args: list[str], *, expect: int = 0) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(_free_port()),
        str(EXAMPLE),
        "--num-workers",
        "0",
        "--seq-len",
        str(SEQ),
        "--batch-size",
        str(ROWS),
        *args,
    ]
    cp = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=150)
    # torchrun reports a worker's exit status 3 as its own status 1
    assert (cp.returncode == 0) == (expect == 0), f"exit {cp.returncode}\n{cp.stdout[-3000:]}\n{cp.stderr[-6000:]}"


@pytest.mark.timeout(420)
def test_torchrun_trainer_resumed_mid_epoch_trains_the_same_batches_per_rank(tmp_path):
    # documents of at most SEQ tokens: best-fit packing splits none, so a document is on one rank only
    lengths = np.random.default_rng(0).integers(1, SEQ + 1, size=60)
    root, _ = write_dataset(str(tmp_path / "d"), [30, 30], lengths=lengths)
    out = tmp_path / "out"
    data = ["--data", root, "--epochs", "2"]
    # A: uninterrupted. B: checkpoints every 5 steps, every rank killed after step 7 (inside epoch 0).
    # C: the same command resumed from B's checkpoint-5 with train(resume_from_checkpoint=...).
    _torchrun([*data, "--output-dir", str(tmp_path / "outA"), "--log-dir", str(tmp_path / "A")])
    _torchrun(
        [
            *data,
            "--output-dir",
            str(out),
            "--save-steps",
            "5",
            "--preempt-at-step",
            "7",
            "--log-dir",
            str(tmp_path / "B"),
        ],
        expect=3,
    )
    assert sorted(os.listdir(out)) == ["checkpoint-5"]
    saved = json.loads((out / "checkpoint-5" / "shardtool_loader.json").read_text())
    assert saved["epoch"] == 0 and sum(s["served"] for s in saved["segments"]) == 5
    _torchrun(
        [*data, "--output-dir", str(out), "--resume", str(out / "checkpoint-5"), "--log-dir", str(tmp_path / "C")]
    )

    # Each rank trains on its own plain loader's batches, epoch after epoch (no DistributedSampler,
    # no DataLoaderShard splitting them again), and no batch or document goes to two ranks.
    want = {r: _plain_epochs(root, 2, rank=r, world_size=2, ranks_per_node=2) for r in (0, 1)}
    n = len(want[0][0])
    assert n >= 5 and all(len(want[r][e]) == n for r in (0, 1) for e in (0, 1))
    a = {r: _records(tmp_path / "A", r) for r in (0, 1)}
    for r in (0, 1):
        assert [x["hash"] for x in a[r]] == want[r][0] + want[r][1]
    for e in (0, 1):
        keys = [{k for x in a[r][e * n : (e + 1) * n] for row in x["keys"] for k in row} for r in (0, 1)]
        assert keys[0] and keys[1] and not keys[0] & keys[1]
    assert not {x["hash"] for x in a[0]} & {x["hash"] for x in a[1]}

    for r in (0, 1):
        whole, b, c = _by_step(a[r]), _by_step(_records(tmp_path / "B", r)), _by_step(_records(tmp_path / "C", r))
        assert b == {s: whole[s] for s in range(7)}  # the killed run trained on A's batches up to there
        # resumed: step 5 on, over the epoch boundary (step n is epoch 1's first batch), A's batch at each step
        assert sorted(c) == list(range(5, 2 * n)) and c == {s: whole[s] for s in range(5, 2 * n)}
        assert c[n] == want[r][1][0]

    # D: the 2-rank checkpoint resumed in one process is refused before training (the Trainer counts
    # epochs from one epoch length; the loader alone could continue on 1 rank)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cp = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            *data,
            "--num-workers",
            "0",
            "--seq-len",
            str(SEQ),
            "--batch-size",
            str(ROWS),
            "--output-dir",
            str(out),
            "--resume",
            str(out / "checkpoint-5"),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cp.returncode != 0 and "LoaderStateError" in cp.stderr and "saved on 2 data-parallel ranks" in cp.stderr


# ------------------------------------------------------------------------------ one process
def _example():
    spec = importlib.util.spec_from_file_location("train_hf_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _trainer(ex, root: str, out: Path, log: Path | None, *extra: str):
    args = ex.parse_args(
        [
            "--data",
            root,
            "--output-dir",
            str(out),
            "--num-workers",
            "0",
            "--seq-len",
            str(SEQ),
            "--batch-size",
            str(ROWS),
            *(["--log-dir", str(log)] if log else []),
            *extra,
        ]
    )
    return ex.build(args)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """A dataset, the example, an uninterrupted run (A) and a run stopped by max_steps=7 (B, checkpoints every 5)."""
    tmp = tmp_path_factory.mktemp("hf1")
    root, _ = write_dataset(str(tmp / "d"), [30, 30])
    ex = _example()
    a = _trainer(ex, root, tmp / "outA", tmp / "A")
    a.train()
    a.train_loader.close()
    b = _trainer(ex, root, tmp / "out", tmp / "B", "--save-steps", "5", "--max-steps", "7")
    b.train()
    b.train_loader.close()
    return ex, root, tmp, _by_step(_records(tmp / "A"))


@pytest.mark.timeout(180)
def test_trainer_resumes_from_its_checkpoint_folder_without_replaying_batches(one_process):
    ex, root, tmp, whole = one_process
    n = len(_plain_epochs(root, 1)[0])
    assert list(whole.values()) == sum(_plain_epochs(root, 2), [])  # the Trainer's epochs are the loader's
    assert sorted(os.listdir(tmp / "out")) == ["checkpoint-5", "checkpoint-7"]
    assert _by_step(_records(tmp / "B")) == {s: whole[s] for s in range(7)}

    c = _trainer(ex, root, tmp / "out", tmp / "C")
    c.train(resume_from_checkpoint=str(tmp / "out" / "checkpoint-5"))
    produced = c.train_loader.loader.metrics()["cumulative"]["batches_produced"]  # a replay would read 0-4 again
    c.train_loader.close()
    resumed = _by_step(_records(tmp / "C"))
    assert sorted(resumed) == list(range(5, 2 * n)) and resumed == {s: whole[s] for s in range(5, 2 * n)}
    assert produced == 2 * n - 5 and c.state.global_step == 2 * n  # across the epoch boundary, nothing read twice


@pytest.mark.timeout(180)
def test_gradient_accumulation_resumes_at_the_batch_after_the_last_optimizer_step(one_process, tmp_path):
    """3 batches per optimizer step, 20 per epoch (the epoch's last step has 2): checkpoint-5 is after
    batch 15 of epoch 0, and the resumed run trains on batches 15.. of the uninterrupted sequence."""
    ex, root, _, _ = one_process
    flat = sum(_plain_epochs(root, 2), [])
    assert len(flat) == 40
    b = _trainer(
        ex, root, tmp_path / "out", tmp_path / "B", "--grad-accum", "3", "--save-steps", "5", "--max-steps", "6"
    )
    b.train()
    b.train_loader.close()
    assert [x["hash"] for x in _records(tmp_path / "B")] == flat[:18]
    c = _trainer(ex, root, tmp_path / "out", tmp_path / "C", "--grad-accum", "3")
    c.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-5"))
    c.train_loader.close()
    assert [x["hash"] for x in _records(tmp_path / "C")] == flat[15:] and c.state.global_step == 2 * 7


@pytest.mark.timeout(180)
def test_ignore_data_skip_starts_the_checkpoints_epoch_over(one_process, tmp_path):
    ex, root, tmp, whole = one_process
    c = _trainer(ex, root, tmp / "out", tmp_path / "C", "--ignore-data-skip")
    c.train(resume_from_checkpoint=str(tmp / "out" / "checkpoint-5"))
    c.train_loader.close()
    # the Trainer's own semantics: epoch 0 from its first batch, counted from step 5 until max_steps (40)
    assert [(x["step"], x["hash"]) for x in _records(tmp_path / "C")] == [(s, whole[s - 5]) for s in range(5, 40)]


@pytest.mark.timeout(180)
def test_resume_true_takes_the_newest_checkpoint(one_process):
    ex, root, tmp, whole = one_process
    import shutil

    shutil.copytree(tmp / "out", tmp / "out-last")
    c = _trainer(ex, root, tmp / "out-last", tmp / "C-last")
    c.train(resume_from_checkpoint=True)
    c.train_loader.close()
    assert _by_step(_records(tmp / "C-last")) == {s: whole[s] for s in range(7, 2 * len(_plain_epochs(root, 1)[0]))}


@pytest.mark.timeout(120)
def test_a_checkpoint_holding_another_datasets_state_is_refused_naming_both(one_process, tmp_path):
    from shardtool.loader import LoaderStateError

    ex, root, tmp, _ = one_process
    other, _ = write_dataset(str(tmp_path / "other"), [20], seed=3)
    trainer = _trainer(ex, other, tmp / "out", None)
    with pytest.raises(LoaderStateError, match="another dataset") as e:
        trainer.train(resume_from_checkpoint=str(tmp / "out" / "checkpoint-5"))
    trainer.train_loader.close()
    assert root in str(e.value) and other in str(e.value)


@pytest.mark.timeout(120)
def test_a_checkpoint_without_a_loader_state_is_refused_naming_the_fix(one_process, tmp_path):
    import shutil

    from shardtool.loader import LoaderStateError

    ex, root, tmp, _ = one_process
    shutil.copytree(tmp / "out" / "checkpoint-5", tmp_path / "checkpoint-5")
    (tmp_path / "checkpoint-5" / "shardtool_loader.json").unlink()
    trainer = _trainer(ex, root, tmp_path, None)
    with pytest.raises(LoaderStateError, match="ignore_data_skip=True"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-5"))
    trainer.train_loader.close()


@pytest.mark.timeout(120)
def test_a_loader_not_at_the_trainers_step_is_refused_before_training(one_process, tmp_path):
    from shardtool.loader import LoaderError

    ex, root, tmp, _ = one_process
    trainer = _trainer(ex, root, tmp_path / "out", None)
    trainer.train_loader.load_state_dict(
        json.loads((tmp / "out" / "checkpoint-5" / "shardtool_loader.json").read_text())
    )
    with pytest.raises(LoaderError, match="at epoch 0, batch 5, but the Trainer starts epoch 0 at batch 0"):
        trainer.train()  # a fresh run: the Trainer starts at step 0
    trainer.train_loader.close()


# ---------------------------------------------------------------------------------- accelerate
@pytest.mark.timeout(120)
def test_accelerate_prepare_passes_the_loader_through_and_save_load_state_restore_it(tmp_path):
    import torch
    from accelerate import Accelerator

    root, _ = write_dataset(str(tmp_path / "d"), [30, 30])
    whole = sum(_plain_epochs(root, 2), [])
    n = len(whole) // 2

    def setup():
        acc = Accelerator(cpu=True)
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = ShardedLoader(root, batch_size=ROWS, seq_len=SEQ, num_workers=0)
        model, opt, prepared = acc.prepare(model, opt, loader)
        assert prepared is loader  # not re-wrapped into a DataLoaderShard that would split it again
        acc.register_for_checkpointing(loader)
        return acc, loader

    acc, loader = setup()
    seen = [_hash(b["input_ids"]) for _, b in zip(range(n - 3), loader)]
    acc.save_state(str(tmp_path / "state"))
    assert "custom_checkpoint_0.pkl" in os.listdir(tmp_path / "state")
    seen += [_hash(b["input_ids"]) for b in loader]  # the rest of epoch 0
    loader.close()

    acc, loader = setup()  # a fresh process's view: new loader, restored mid-epoch
    acc.load_state(str(tmp_path / "state"))
    rest = [_hash(b["input_ids"]) for b in loader]
    rest += [_hash(b["input_ids"]) for b in loader]  # the next iter() is epoch 1
    loader.close()
    assert seen == whole[:n] and rest == whole[n - 3 :]


@pytest.mark.timeout(180)
def test_the_example_trains_on_the_readmes_corpus(tmp_path):
    """The README's corpus (`shardtool.benchmarks.corpus`, token ids up to 49,999) with the example's
    tiny vocabulary: ids fold onto it, as the other examples' do (an IndexError in the embedding before)."""
    import shardtool
    from shardtool.benchmarks import corpus

    corpus.write_tokens(str(tmp_path / "raw"), 400, seed=0, jsonl=False)
    root = str(tmp_path / "ds")
    shardtool.pack(str(tmp_path / "raw" / "tokens.parquet"), root, length="tokens")
    trainer = _trainer(_example(), root, tmp_path / "out", None, "--max-steps", "3")
    trainer.train()
    trainer.train_loader.close()
    assert trainer.state.global_step == 3
