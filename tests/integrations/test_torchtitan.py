"""ShardedLoader inside torchtitan: saved and restored by torchtitan's own CheckpointManager (DCP,
gloo, CPU), exact mid-epoch resume per rank, and a resume on another DP size (which torchtitan's
own loader refuses, torchtitan #811).

Ranks are forked from tests/helpers/titan_worker.py (tests/helpers/forkranks.py), one subprocess per job list, with
a timeout. A worker builds ``CheckpointManager`` as torchtitan's trainer does (dataloader, a
one-layer model, train_state), loads the newest ``step-N`` and saves every K steps.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.s3server import free_port
from helpers.skips import require
from test_loader_data import write_dataset

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "helpers" / "titan_worker.py"
INSTALL = (
    "pip install --no-deps torchtitan==0.3.0 torchdata==0.11.0 torch_checkpointing==0.1.1 spmd_types==0.2.3 "
    "tyro==1.0.17 docstring_parser==0.18.0 (tests/run.sh does)"
)
SAVE_AT = 5  # 2 x 5 batches left of a 10-step epoch: on 3 ranks, 3 each and 1 left over


@pytest.fixture(autouse=True)
def _torchtitan_installed(request):
    if "importing" not in request.node.name:
        require(importlib.util.find_spec("torchtitan") is not None, f"needs torchtitan: {INSTALL}")


def _forked(jobs: list[dict], tmp: Path, timeout: float) -> list[list]:
    path = tmp / f"jobs{len(list(tmp.glob('jobs*.json')))}.json"
    path.write_text(json.dumps(jobs))
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cp = subprocess.run(
        [sys.executable, str(WORKER), str(path)], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert cp.returncode == 0, cp.stderr[-4000:]
    return [json.loads(line)["ranks"] for line in cp.stdout.splitlines()]


def _job(world: int, out: Path, data: str, ckpt: Path, *argv: str) -> dict:
    return {"world": world, "out": str(out), "limit": 120, "argv": ["--data", data, "--ckpt", str(ckpt), *argv]}


def _steps(out: Path, rank: int) -> dict[int, str]:
    with open(out / f"steps.rank{rank}.jsonl") as f:
        return {r["step"]: r["hash"] for r in map(json.loads, f)}


def _log(out: Path, rank: int) -> str:
    return (out / f"rank{rank}.log").read_text()[-3000:]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """An uninterrupted 2-rank epoch (A), and a 2-rank run checkpointed at step 4 and preempted at 6 (B)."""
    require(importlib.util.find_spec("torchtitan") is not None, f"needs torchtitan: {INSTALL}")
    tmp = tmp_path_factory.mktemp("titan")
    root, _ = write_dataset(str(tmp / "data"), [30, 30])
    ckpt = tmp / "ckB"
    ranks = _forked(
        [
            _job(2, tmp / "A", root, tmp / "ckA"),
            _job(2, tmp / "B", root, ckpt, "--save-every", str(SAVE_AT), "--stop-at", str(SAVE_AT + 2)),
        ],
        tmp,
        timeout=280,
    )
    for job, out in zip(ranks, ("A", "B")):
        assert [rc for rc, _ in job] == [0, 0], _log(tmp / out, 0)
    assert sorted(os.listdir(ckpt)) == [f"step-{SAVE_AT}"]
    return tmp, root, ckpt


@pytest.mark.timeout(300)
def test_checkpoint_holds_one_rank_identical_state_under_torchtitans_keys(saved):
    import torch.distributed.checkpoint as dcp

    _, _, ckpt = saved
    keys = dcp.FileSystemReader(str(ckpt / f"step-{SAVE_AT}")).read_metadata().state_dict_metadata
    assert sorted(k for k in keys if k.startswith("dataloader.")) == ["dataloader.dp_rank_0", "dataloader.world_size"]


@pytest.mark.timeout(300)
def test_resume_on_the_same_dp_size_trains_the_uninterrupted_runs_batches_per_rank(saved, tmp_path):
    tmp, root, ckpt = saved
    [ranks] = _forked([_job(2, tmp_path / "C", root, ckpt)], tmp_path, timeout=200)
    assert [rc for rc, _ in ranks] == [0, 0], _log(tmp_path / "C", 0)
    for r in range(2):
        whole = _steps(tmp / "A", r)
        assert _steps(tmp / "B", r) == {s: whole[s] for s in range(1, SAVE_AT + 3)}
        assert _steps(tmp_path / "C", r) == {s: whole[s] for s in range(SAVE_AT + 1, len(whole) + 1)}


@pytest.mark.parametrize("world", [3, 1])
@pytest.mark.timeout(300)
def test_resume_on_another_dp_size_serves_the_rest_of_the_epoch_once(saved, tmp_path, world):
    tmp, root, ckpt = saved
    [ranks] = _forked([_job(world, tmp_path / "E", root, ckpt)], tmp_path, timeout=200)
    assert [rc for rc, _ in ranks] == [0] * world, _log(tmp_path / "E", 0)
    before = [h for r in range(2) for s, h in _steps(tmp / "A", r).items() if s <= SAVE_AT]
    rest = [h for r in range(2) for s, h in _steps(tmp / "A", r).items() if s > SAVE_AT]
    after = [h for r in range(world) for h in _steps(tmp_path / "E", r).values()]
    leftover = [json.loads((tmp_path / "E" / f"leftover.rank{r}.json").read_text()) for r in range(world)]
    # Equal batch counts per rank, none repeated, nothing from before the checkpoint, and none
    # skipped beyond the documented leftover of the re-deal (the same on every rank: one plan).
    assert len({len(_steps(tmp_path / "E", r)) for r in range(world)}) == 1
    assert len(set(after)) == len(after) and not set(after) & set(before)
    assert set(after) <= set(rest)  # the rest is re-dealt as whole batches
    n_left = leftover[0]["leftover_batches"]
    assert all(lo["leftover_batches"] == n_left for lo in leftover)
    assert n_left == (1 if world == 3 else 0) and len(rest) == 2 * 5  # the case the SAVE_AT comment sets up
    assert len(after) + n_left == len(rest)


@pytest.mark.timeout(300)
def test_a_state_from_another_dataset_is_refused_naming_both(saved, tmp_path):
    tmp, root, ckpt = saved
    other, _ = write_dataset(str(tmp_path / "other"), [20], seed=3)
    [ranks] = _forked([_job(2, tmp_path / "F", other, ckpt)], tmp_path, timeout=200)
    assert [rc for rc, _ in ranks] == [3, 3], _log(tmp_path / "F", 0)
    err = (tmp_path / "F" / "error.rank0.txt").read_text()
    assert "another dataset" in err and root in err and other in err, err


@pytest.mark.timeout(60)
def test_a_state_saved_by_torchtitans_own_loader_is_refused_naming_the_fix(tmp_path):
    from shardtool.integrations.torchtitan import TitanLoader
    from shardtool.loader import LoaderStateError, ShardedLoader

    root, _ = write_dataset(str(tmp_path / "d"), [10])
    titan = TitanLoader(ShardedLoader(root, batch_size=2, seq_len=33, num_workers=0))
    with pytest.raises(LoaderStateError, match=r"ParallelAwareDataloader.*exclude_from_loading=\['dataloader'\]"):
        titan.load_state_dict({"dp_rank_0": b"pickled StatefulDataLoader state", "world_size": 2})
    titan.close()


@pytest.mark.timeout(240)
def test_the_example_trains_checkpoints_and_resumes(tmp_path):
    """examples/train_torchtitan.py under torchrun: 12 steps checkpointed every 4, then a second
    launch resumes from step-12 and trains on to 16."""
    root, _ = write_dataset(str(tmp_path / "data"), [60, 60])
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(REPO / "examples" / "train_torchtitan.py"),
        "--data",
        root,
        "--ckpt",
        str(tmp_path / "ckpt"),
        "--save-every",
        "4",
        "--seq-len",
        "16",
        "--batch-size",
        "2",
        "--vocab",
        "30000",
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    first = subprocess.run([*cmd, "--steps", "12"], env=env, capture_output=True, text=True, timeout=110)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "step-12" in os.listdir(tmp_path / "ckpt")
    second = subprocess.run([*cmd, "--steps", "16"], env=env, capture_output=True, text=True, timeout=110)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed at step 12" in second.stdout and "step-16" in os.listdir(tmp_path / "ckpt")
