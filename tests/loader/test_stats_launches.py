"""`shardtool stats` of jobs launched by hand on one static rendezvous (MASTER_ADDR/PORT, no SLURM
or torchrun id): every launch wrote under the same run id, so two 2-rank jobs were reported as one
run of twice the steps, their waits and rates mixed. Launches are told apart by their processes;
one process's training and evaluation loaders stay one launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import shardtool
from helpers.realtext import byte_ids, stdlib_files
from helpers.runcli import repo_env, shardtool_cli
from shardtool.loader.observability import stats

pytestmark = pytest.mark.timeout(180)

RANK = """
import sys
from shardtool.loader import ShardedLoader
url, rank, metrics, loaders = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
for _ in range(loaders):  # a training loader, then an evaluation one, in one process
    ld = ShardedLoader(url, seq_len=512, batch_size=2, rank=rank, world_size=2, ranks_per_node=2,
                       num_workers=0, metrics_dir=metrics, metrics_every=1)
    n = sum(1 for _ in ld)
    ld.close()
print(n)
"""


def _launch(url: str, metrics: str, loaders: int = 1) -> int:
    env = dict(repo_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    for key in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, url, str(r), metrics, str(loaders)], env=env, stdout=subprocess.PIPE, text=True
        )
        for r in range(2)
    ]
    out = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    return int(out[0])


def test_two_launches_on_one_rendezvous_are_two_runs(tmp_path):
    root = str(tmp_path / "ds")
    shardtool.pack([{"tokens": byte_ids(p)} for p in stdlib_files(40)], root, length="tokens")
    metrics = str(tmp_path / "metrics")
    batches = _launch(root, metrics)
    _launch(root, metrics, loaders=2)
    lines, bad = stats.read_lines(stats.metric_files([metrics]))
    got = stats.runs(lines)
    assert bad == 0 and list(got) == ["master-127.0.0.1-29533#1", "master-127.0.0.1-29533#2"]
    first, second = (stats.summarize(v) for v in got.values())
    assert [r["steps"] for r in first["ranks"]] == [batches, batches]
    assert [r["processes"] for r in first["ranks"]] == [1, 1]
    assert [r["steps"] for r in second["ranks"]] == [2 * batches, 2 * batches]  # its two loaders, one launch
    cp = shardtool_cli("stats", metrics)
    assert cp.returncode == 0 and "run master-127.0.0.1-29533#2: 2 rank(s)" in cp.stdout, cp.stderr
    assert "master-127.0.0.1-29533#1; pick one with --run" in cp.stderr
    assert os.path.isdir(metrics)
    # `--json DIR` (the option before the directory): --json takes an optional file, and took the
    # directory as the file to write; a directory is what to read.
    as_json = shardtool_cli("stats", "--json", metrics)
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout)["run"] == "master-127.0.0.1-29533#2"
    none = shardtool_cli("stats")
    assert none.returncode != 0 and "give the metric directories" in none.stderr
