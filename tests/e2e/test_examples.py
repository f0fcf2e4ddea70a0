"""The examples users copy are run here, so they cannot rot.

(examples/train_ddp.py, slurm/prolog.sh and slurm/train.sbatch run in tests/slurm/test_e2e_train.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _env(**extra) -> dict:
    env = dict(os.environ)
    # the examples call `python` and `shardtool` as a user would: this interpreter's bin dir first
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(REPO)
    env.update(extra)
    return env


def _run(argv, timeout, **extra) -> subprocess.CompletedProcess:
    cp = subprocess.run(argv, cwd=REPO, env=_env(**extra), capture_output=True, text=True, timeout=timeout)
    assert cp.returncode == 0, f"{argv} exited {cp.returncode}\n{cp.stdout[-4000:]}\n{cp.stderr[-4000:]}"
    return cp


@pytest.mark.timeout(300)
def test_convert_jsonl_example(tmp_path):
    cp = _run(["bash", "examples/convert_jsonl.sh", str(tmp_path)], 280, N="3000")
    assert "OK" in cp.stdout + cp.stderr
    from shardtool import open_dataset

    assert len(open_dataset(str(tmp_path / "ds"))) == 3000
    assert len(open_dataset(str(tmp_path / "ds-array"))) == 3000


@pytest.mark.timeout(300)
def test_convert_images_example(tmp_path):
    cp = _run(["bash", "examples/convert_images.sh", str(tmp_path)], 280, N="300")
    assert "300 samples via webdataset" in cp.stdout


@pytest.mark.timeout(600)
def test_quickstart_main_job_end_to_end(tmp_path):
    work = tmp_path / "qs"
    cp = _run(
        ["bash", "examples/quickstart.sh"],
        580,
        WORK=str(work),
        SAMPLES="3000",
        BENCH_BATCHES="20",
        SHARDTOOL_NO_INSTALL="1",
        OMP_NUM_THREADS="1",
    )
    out = cp.stdout
    assert "checks: equal steps, exactly once, remainder as planned: OK" in out, out[-4000:]
    bench = json.loads((work / "bench.json").read_text())
    readers = {r["reader"] for r in bench["rows"]}
    assert readers == {"shardtool", "webdataset"} and not any(r["errors"] for r in bench["rows"])
    assert (work / "dataset" / "index.json").exists()  # moved back after training from the caches
    stats = out.split("== 6. loader metrics")[1]
    assert "4 rank(s) on 2 node(s)" in stats and "slowest ranks" in stats, stats
    assert "data wait" in out  # train_ddp.py's metric line on rank 0
    assert (work / "loader-stats.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
