"""Fetch-on-demand into a node cache that starts empty, by 2 ranks x 2 workers at once.

The case the README promises works when the prolog could not warm: every worker of both ranks
misses the same shards at the first steps. A worker that found a shard untrusted and then waited
for its lock used to wait for good: the other rank's worker fetched the shard and kept holding
its lock as a reader while its shard was open, and that rank then waited for this one at the
next collective. Every run must finish, with the batches of an uncached read.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from helpers.s3server import free_port
from shardtool.loader import ShardedLoader
from test_loader_data import read_all, write_dataset

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)
WORKER = os.path.join(TESTS, "helpers", "cold_cache_worker.py")
STEPS = 8
RUNS = 5


def torchrun(url: str, cache_dir: str, out: str, *, latency: float, timeout: float):
    os.makedirs(out, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        WORKER,
        "--data",
        url,
        "--cache-dir",
        cache_dir,
        "--out",
        out,
        "--latency",
        str(latency),
        "--max-steps",
        str(STEPS),
        "--num-workers",
        "2",
        "--collective-timeout",
        "20",
    ]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as e:  # subprocess.run killed torchrun; its ranks die with it
        pytest.fail(f"2 ranks x 2 workers on an empty cache did not finish within {timeout}s: {e.stderr}")


@pytest.mark.timeout(RUNS * 90 + 60)
def test_two_ranks_with_two_workers_each_fill_an_empty_cache_without_deadlock(tmp_path):
    # Few large-ish shards, so that both ranks' workers want the same shard at the first steps.
    lengths = np.random.default_rng(0).integers(200, 1500, size=4 * 150)
    src, _ = write_dataset(str(tmp_path / "src"), [150] * 4, lengths=lengths, extra=False)
    expected = [
        read_all(ShardedLoader(src, max_tokens=2048, seed=0, rank=r, world_size=2, ranks_per_node=2, num_workers=0))[
            :STEPS
        ]
        for r in range(2)
    ]
    # A source slow per request (as object storage is) keeps each fetch in flight long enough for
    # the other rank's workers to miss the same shard and wait for its lock.
    url = "faulty://" + src
    for run in range(RUNS):
        cache_dir, out = str(tmp_path / f"cache{run}"), str(tmp_path / f"out{run}")
        os.makedirs(cache_dir)
        res = torchrun(url, cache_dir, out, latency=0.02, timeout=90)
        assert res.returncode == 0, f"run {run}: exit {res.returncode}\n{res.stderr[-3000:]}"
        got = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]
        assert got == expected, f"run {run}"
