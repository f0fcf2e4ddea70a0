"""ShardedLoader as Megatron-core's external train iterator: megatron.core.parallel_state initialised
on CPU with gloo under torchrun (2 processes, subprocess with a timeout), as 2 DP ranks (exact resume
from save_state across an epoch boundary) and as 1 DP x 2 TP (only TP rank 0 builds; both would
get the same batch). Megatron-LM's training loop is not in the megatron-core wheel, so the worker
drives the iterator as its RerunDataIterator does: next() once per micro-batch."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import megatron.core  # noqa: F401  a declared test dependency, imported plainly (tests/helpers/skips.py)
import pytest
import torch

from shardtool.integrations.megatron import STATE_FILE, MegatronIterator, build_iterator
from shardtool.loader import LoaderStateError
from test_loader_data import write_dataset

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "helpers" / "megatron_worker.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(*args: str) -> None:
    env = dict(os.environ, PYTHONPATH=f"{REPO}:{REPO / 'tests'}", OMP_NUM_THREADS="1")
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
        str(WORKER),
        *args,
    ]
    # its own process group: a timeout ends torchrun's workers too, not only torchrun
    with subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as proc:
        try:
            out, err = proc.communicate(timeout=150)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise AssertionError(f"torchrun timed out after 150 s\n{out[-3000:]}\n{err[-6000:]}") from None
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-3000:]}\n{err[-6000:]}"


def _records(log: Path, rank: int) -> list[dict]:
    with open(f"{log}.rank{rank}.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    root, _ = write_dataset(str(tmp_path_factory.mktemp("mg") / "d"), [30, 30])
    return root


@pytest.mark.timeout(400)
def test_two_dp_ranks_resume_from_save_state_exactly_across_an_epoch_boundary(data, tmp_path):
    # 10 batches per rank per epoch; A: 25 steps uninterrupted. B: saves after step 7 and stops at 8.
    # C: a fresh run restored from B's folder, steps 7..24 (over the boundaries at 10 and 20).
    _torchrun("--data", data, "--out", str(tmp_path / "A"), "--steps", "25")
    _torchrun(
        "--data", data, "--out", str(tmp_path / "B"), "--steps", "8", "--save-at", "7", "--ckpt", str(tmp_path / "ckpt")
    )
    assert os.listdir(tmp_path / "ckpt") == [STATE_FILE]  # one file, written once (DP rank 0), no temporary left
    _torchrun(
        "--data",
        data,
        "--out",
        str(tmp_path / "C"),
        "--steps",
        "18",
        "--first-step",
        "7",
        "--restore",
        str(tmp_path / "ckpt"),
    )
    a = {r: _records(tmp_path / "A", r) for r in (0, 1)}
    for r in (0, 1):
        whole = {x["step"]: x["hash"] for x in a[r]}
        assert all(x["ok"] for x in a[r]) and [x["epoch"] for x in a[r]][9:11] == [1, 1]  # after batch 10: epoch 1
        assert {x["step"]: x["hash"] for x in _records(tmp_path / "B", r)} == {s: whole[s] for s in range(8)}
        resumed = {x["step"]: x["hash"] for x in _records(tmp_path / "C", r)}
        assert resumed == {s: whole[s] for s in range(7, 25)}
        assert whole[0] != whole[10]  # the next epoch is another order, not a replay
    assert not {x["hash"] for x in a[0]} & {x["hash"] for x in a[1]}  # the DP ranks read different batches


@pytest.mark.timeout(300)
def test_tensor_parallel_peers_only_rank_0_builds_and_both_would_get_the_same_batches(data, tmp_path):
    _torchrun("--data", data, "--out", str(tmp_path / "T"), "--tp", "2", "--steps", "12")
    assert len(_records(tmp_path / "T", 0)) == 12 and _records(tmp_path / "T", 1) == [{"built": False}]
    _torchrun("--data", data, "--out", str(tmp_path / "E"), "--tp", "2", "--steps", "12", "--everywhere")
    e0, e1 = _records(tmp_path / "E", 0), _records(tmp_path / "E", 1)
    assert e0 == e1 == _records(tmp_path / "T", 0)


# ------------------------------------------------------------------------------ one process
def _iterator(root: str, **kw) -> MegatronIterator:
    # explicit ranks: parallel_state is not initialised in this process
    return build_iterator(root, seq_len=32, batch_size=2, num_workers=0, dp_rank=0, dp_size=1, **kw)


@pytest.mark.timeout(60)
def test_batches_have_megatrons_keys_and_loss_mask_matches_labels(data):
    it, plain = _iterator(data), _iterator(data)
    ours = next(iter(plain.loader))  # the loader's own first batch, beside the iterator's
    plain.close()
    b = next(it)
    assert set(b) == {"tokens", "labels", "loss_mask", "position_ids", "cu_seqlens", "max_seqlen"}
    assert torch.equal(b["tokens"], ours["input_ids"]) and torch.equal(b["position_ids"], ours["position_ids"])
    ignored = ours["labels"] == -100
    assert ignored.any() and torch.equal(b["loss_mask"], (~ignored).float())
    assert torch.equal(b["labels"][~ignored], ours["labels"][~ignored]) and not b["labels"][ignored].any()
    assert torch.equal(b["cu_seqlens"], ours["cu_seqlens"].int()) and b["max_seqlen"].tolist() == [ours["max_seqlen"]]
    it.close()


@pytest.mark.timeout(60)
def test_restoring_a_state_of_another_dataset_names_both(data, tmp_path):
    other, _ = write_dataset(str(tmp_path / "other"), [20, 20], seed=3)
    it = _iterator(other)
    next(it)
    it.save_state(tmp_path / "ck")
    it.close()
    with pytest.raises(LoaderStateError, match="another dataset") as e:
        _iterator(data, restore=tmp_path / "ck")
    assert str(Path(other).name) in str(e.value) and str(Path(data).name) in str(e.value)
    fresh = _iterator(data)
    with pytest.raises(LoaderStateError, match=STATE_FILE):
        fresh.restore_state(tmp_path / "nowhere" / STATE_FILE)
    fresh.close()


@pytest.mark.timeout(60)
def test_save_state_to_a_folder_that_cannot_be_written_names_the_path(data, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    it = _iterator(data)
    next(it)
    with pytest.raises(OSError, match=str(blocker / "sub" / STATE_FILE)):
        it.save_state(blocker / "sub")
    assert it.save_state()["epoch"] == 0  # without a folder: the state, as Megatron's --dataloader-save asks
    it.close()


@pytest.mark.timeout(60)
def test_megatrons_own_dataloader_save_file_restores(data, tmp_path):
    a = _iterator(data)
    for _ in range(3):
        next(a)
    torch.save({"dataloader_state_dict": a.save_state()}, tmp_path / "train_dataloader_dprank000.pt")
    want = next(a)
    a.close()
    b = _iterator(data)
    b.restore_state(torch.load(tmp_path / "train_dataloader_dprank000.pt"))
    assert torch.equal(next(b)["tokens"], want["tokens"])
    b.close()


@pytest.mark.timeout(60)
def test_the_example_provider_restores_from_megatrons_dataloader_save_file(data, tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("megatron_data_example", REPO / "examples" / "megatron_data.py")
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    # the example takes its ranks from parallel_state, as under Megatron: one rank, one process
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    ps.initialize_model_parallel()
    try:
        _example_resume(ex, data, tmp_path)
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def _example_resume(ex, data: str, tmp_path: Path) -> None:
    from types import SimpleNamespace

    def checkpoint_name(root, iteration, pipeline_rank=None, basename=None):  # Megatron's layout of the file
        return os.path.join(root, f"iter_{iteration:07d}", basename)

    args = SimpleNamespace(
        data_path=[data],
        seq_length=32,
        micro_batch_size=2,
        num_workers=0,
        load=None,
        dataloader_save=str(tmp_path / "data"),
        iteration=0,
    )
    first = ex.build_train_iterator(args, checkpoint_name)
    for _ in range(4):
        next(first)
    path = checkpoint_name(args.dataloader_save, 4, basename=ex.STATE_BASENAME)
    os.makedirs(os.path.dirname(path))
    torch.save({"dataloader_state_dict": first.save_state()}, path)  # what Megatron's checkpointing writes
    want = next(first)["tokens"]
    first.close()
    args.load, args.iteration = str(tmp_path / "ckpt"), 4
    resumed = ex.build_train_iterator(args, checkpoint_name)
    assert torch.equal(next(resumed)["tokens"], want)
    resumed.close()
