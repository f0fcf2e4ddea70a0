"""The stager under a cache budget (``--max-bytes``/``--min-free``, as `warm` applies it): it stages
what fits beside what the cache holds, in the ranks' order, says once what it left to the readers,
and evicts nothing. Real files, a real cache; the stager runs in a thread (and once as the CLI)."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from helpers.cachedata import child_env
from shardtool.cache import open_cache, warm
from shardtool.cache.stager import Board, board_dir, follow
from shardtool.plan.stageorder import TouchOrder
from test_loader_data import write_dataset

SHARDS = 12


@pytest.fixture
def src(tmp_path):
    root, _ = write_dataset(str(tmp_path / "src"), [20] * SHARDS, extra=False)
    return root


def cached_bytes(cache_dir: str) -> int:
    """Bytes of every shard file of every version in the cache (what a budget counts)."""
    return sum(os.path.getsize(p) for p in glob.glob(os.path.join(cache_dir, "*", "**", "*.tar"), recursive=True))


def stage_all(cache, order: np.ndarray) -> tuple:
    """One rank that publishes ``order`` and is at its end already: every shard is due at once."""
    path = board_dir(cache.cache_dir, "job", cache.version)
    Board(path, 0).publish_order(0, TouchOrder(order, np.arange(len(order))), len(order))
    lines: list[str] = []
    stop = threading.Event()
    timer = threading.Timer(30, stop.set)  # a stager that never finishes fails the test, not the run
    timer.start()
    try:
        report = follow(cache, run="job", ranks=1, ahead_shards=SHARDS, jobs=3, poll=0.005, stop=stop, log=lines.append)
    finally:
        timer.cancel()
    return report, lines


@pytest.mark.timeout(60)
def test_the_stager_stages_what_fits_in_order_and_evicts_nothing(src, tmp_path):
    cache_dir = str(tmp_path / "cache")
    other, _ = write_dataset(str(tmp_path / "other"), [20, 20], extra=False, seed=1, prefix="o")
    assert warm(other, cache_dir, progress=False).status == "ok"  # another dataset's shards, idle
    held = cached_bytes(cache_dir)
    probe = open_cache(src, cache_dir)
    sizes = [s.bytes for s in probe.manifest.shards]
    order = np.arange(SHARDS)[::-1].copy()  # shard 11 first
    budget = held + sum(sizes[i] for i in order[:5]) + 10  # room for the first five of the order, no more
    cache = open_cache(src, cache_dir, max_bytes=budget)
    report, lines = stage_all(cache, order)
    assert report.status == "done" and not report.failures
    staged = [i for i, info in enumerate(cache.manifest.shards) if cache.vdir.trusted(i, info)]
    assert staged == sorted(order[:5].tolist())  # the most urgent first
    assert report.shards_copied == 5 and report.not_fitted == order[5:].tolist()
    assert cached_bytes(cache_dir) <= budget
    assert cached_bytes(cache_dir) - held == sum(sizes[i] for i in staged)  # the other dataset is all there
    budget_lines = [m for m in lines if "cache budget" in m]
    assert len(budget_lines) == 1 and "\n" not in budget_lines[0], lines
    assert f"--max-bytes={budget}" in budget_lines[0] and "fetch-on-miss" in budget_lines[0]
    assert "7 left over the cache budget" in report.summary()


@pytest.mark.timeout(60)
def test_without_a_budget_the_stager_stages_every_shard(src, tmp_path):
    cache = open_cache(src, str(tmp_path / "cache"))
    report, lines = stage_all(cache, np.arange(SHARDS))
    assert (report.status, report.shards_copied, report.not_fitted) == ("done", SHARDS, [])
    assert not any("cache budget" in m for m in lines)


@pytest.mark.timeout(120)
def test_warm_follow_applies_its_max_bytes(src, tmp_path):
    cache_dir = str(tmp_path / "cache")
    probe = open_cache(src, cache_dir)
    budget = sum(s.bytes for s in probe.manifest.shards[:3]) + 10
    Board(board_dir(cache_dir, "job", probe.version), 0).publish_order(
        0, TouchOrder(np.arange(SHARDS), np.arange(SHARDS)), SHARDS
    )
    cmd = [sys.executable, "-m", "shardtool", "warm", src, "--cache-dir", cache_dir, "--follow", "--run", "job"]
    cmd += ["--nodes", "1", "--node-rank", "0", "--ranks-per-node", "1", "--max-bytes", str(budget)]
    res = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=100, check=False)
    assert res.returncode == 0, res.stderr
    assert "cache budget" in res.stderr and "staged 3 shard(s)" in res.stderr, res.stderr
    assert cached_bytes(cache_dir) <= budget
