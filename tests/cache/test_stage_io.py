"""The node's stager (shardtool.cache.stager) against a real cache and source: it stays within its
bound of the slowest reader, a reader waits for the shard it is fetching instead of fetching it
again, and it stops when it should. Real files, real flock locks; the stager runs in a thread."""

from __future__ import annotations

import glob
import json
import os
import threading
import time

import numpy as np
import pytest

from helpers import faultfs  # noqa: F401  registers faulty://
from shardtool.cache import open_cache
from shardtool.cache.locks import held_exclusively
from shardtool.cache.stager import (
    Board,
    Throttle,
    board_dir,
    follow,
    read_board,
    stage_run,
)
from shardtool.plan.stageorder import TouchOrder
from test_loader_data import read_all, write_dataset

SHARDS = 12


@pytest.fixture
def src(tmp_path):
    root, _ = write_dataset(str(tmp_path / "src"), [20] * SHARDS, extra=False)
    return root


def cached(cache) -> list[int]:
    return [i for i, info in enumerate(cache.manifest.shards) if cache.vdir.trusted(i, info)]


def until(cond, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"not within {timeout}s: {cond.__doc__ or cond}")
        time.sleep(0.01)


class Running:
    """`follow` in a thread; ``.report`` once it returned."""

    def __init__(self, cache, **kw):
        self.stop = threading.Event()
        self.report = None
        self.thread = threading.Thread(target=self._run, args=(cache, kw), daemon=True)
        self.thread.start()

    def _run(self, cache, kw):
        self.report = follow(cache, stop=self.stop, poll=0.005, log=lambda m: None, **kw)

    def join(self, timeout: float = 20.0):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the stager did not stop"
        return self.report


@pytest.mark.timeout(60)
def test_the_stager_fetches_in_order_and_stays_within_its_bound_of_the_slowest_reader(src, tmp_path):
    cache = open_cache(src, str(tmp_path / "cache"))
    path = board_dir(cache.cache_dir, "job", cache.version)
    order = TouchOrder(np.arange(SHARDS)[::-1].copy(), np.arange(SHARDS))  # shard 11 is read first
    fast, slow = Board(path, 0), Board(path, 1)
    fast.publish_order(0, order, 0)
    slow.publish_order(0, order, 0)
    stager = Running(cache, run="job", ranks=2, ahead_shards=3, jobs=2)
    until(lambda: len(cached(cache)) == 4)  # due at step 0: shard 11; 3 ahead: 10, 9, 8
    fast.progress(0, 9)  # the fast reader does not pull the stager along
    time.sleep(0.3)
    assert cached(cache) == [8, 9, 10, 11]
    slow.progress(0, 5)  # due: steps 0..5 (shards 11..6); ahead: 5, 4, 3
    until(lambda: len(cached(cache)) == 9)
    time.sleep(0.2)
    assert cached(cache) == list(range(3, 12))
    slow.progress(0, SHARDS)
    report = stager.join()
    assert report.status == "done" and report.shards_copied == SHARDS and not report.failures
    # Every fetch started inside the window of its moment, the most urgent first.
    assert all(index < end for _, _, index, end, _ in report.fetches)
    assert [shard for _, shard, *_ in report.fetches] == list(range(SHARDS))[::-1]
    assert os.path.exists(os.path.join(path, f"stager-{os.getpid()}.json"))


@pytest.mark.timeout(60)
def test_over_a_prolog_warmed_cache_the_stager_copies_nothing_and_stops(src, tmp_path):
    from shardtool.cache import warm

    cache_dir = str(tmp_path / "cache")
    assert warm(src, cache_dir, progress=False).status == "ok"
    cache = open_cache(src, cache_dir)
    board = Board(board_dir(cache_dir, "job", cache.version), 0)
    board.publish_order(0, TouchOrder(np.arange(SHARDS), np.arange(SHARDS)), 0)
    report = Running(cache, run="job", ranks=1, ahead_shards=2).join(5)
    assert (report.status, report.shards_copied, report.shards_present) == ("done", 0, SHARDS)


@pytest.mark.timeout(60)
def test_a_reader_waits_for_the_shard_the_stager_is_fetching_and_the_source_serves_it_once(src, tmp_path):
    cache_dir = str(tmp_path / "cache")
    # The stager's reads of shard 0 stall 1 s, so the reader surely misses it while it is in flight.
    staging = open_cache("faulty://" + src, cache_dir, storage_options={"stall": {"shard-00000.tar": [1.0, 1]}})
    board = Board(board_dir(cache_dir, "job", staging.version), 0)
    board.publish_order(0, TouchOrder(np.array([0]), np.array([0])), 0)
    stager = Running(staging, run="job", ranks=1, ahead_shards=1, jobs=1)
    lock = staging.vdir.lock_path(0)
    until(lambda: held_exclusively(lock))
    reader = open_cache("faulty://" + src, cache_dir)
    began = time.monotonic()
    path = reader.local_shard(0)  # a loader's fetch-on-miss
    waited = time.monotonic() - began
    assert os.path.getsize(path) == reader.manifest.shards[0].bytes
    shard = reader.source().path(reader.manifest.shards[0].path)
    assert reader.fetched_bytes == 0 and reader.source().fs.requests[shard] == 0, "the reader fetched it too"
    assert staging.source().fs.requests[shard] >= 1
    assert waited > 0.3, f"the reader did not wait for the stager's fetch ({waited:.2f}s)"
    report = stager.join()
    assert (report.status, report.shards_copied) == ("done", 1)


@pytest.mark.timeout(60)
def test_the_stager_stops_when_every_rank_closed_and_ignores_a_previous_jobs_marks(src, tmp_path):
    cache = open_cache(src, str(tmp_path / "cache"))
    path = board_dir(cache.cache_dir, "job", cache.version)
    old = Board(path, 0)
    old.close()  # a previous job of the same run id closed its loader
    os.utime(os.path.join(path, "closed-0"), (time.time() - 60, time.time() - 60))
    stager = Running(cache, run="job", ranks=1, ahead_shards=2)
    time.sleep(0.3)
    assert stager.thread.is_alive(), "a previous job's mark stopped the stager"
    board = Board(path, 0)
    board.publish_order(0, TouchOrder(np.arange(SHARDS), np.arange(SHARDS)), 0)
    until(lambda: len(cached(cache)) == 3)
    board.close()  # this job's loader closed at step 0: no reader left to stage for
    assert stager.join().status == "closed"
    assert len(cached(cache)) == 3
    assert read_board(path).closed == {0}


def test_the_run_id_is_the_jobs_not_the_steps():
    assert stage_run({"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "1"}) == stage_run({"SLURM_JOB_ID": "42"}) == "42"
    assert stage_run({"SHARDTOOL_STAGE_RUN": "a/b", "SLURM_JOB_ID": "42"}) == "a_b"
    assert stage_run({"TORCHELASTIC_RUN_ID": "none"}) == "local"


def test_the_throttle_holds_the_average_rate():
    throttle = Throttle(2e6)
    began = time.monotonic()
    for _ in range(5):
        throttle(100_000)
    assert time.monotonic() - began >= 0.2  # 500 kB at 2 MB/s


def test_the_loader_refuses_staging_it_cannot_do(src, tmp_path, monkeypatch):
    from shardtool.loader import ShardedLoader
    from shardtool.loader.rankstaging import stage_mode, stager_options

    with pytest.raises(ValueError, match="cache_dir"):
        ShardedLoader(src, batch_size=4, rank=0, world_size=1, num_workers=0, stage=True)
    with pytest.raises(ValueError, match="SHARDTOOL_STAGE must be"):
        stage_mode(None, {"SHARDTOOL_STAGE": "yes"})
    with pytest.raises(ValueError, match="stage must be"):
        stage_mode("on", {})
    assert stage_mode(None, {"SHARDTOOL_STAGE": "external"}) == "external" and stage_mode(None, {}) is False
    with pytest.raises(ValueError, match="SHARDTOOL_STAGE_AHEAD must be >= 1"):
        stager_options({"SHARDTOOL_STAGE_AHEAD": "0"})
    assert stager_options({"SHARDTOOL_STAGE_BANDWIDTH": "2M"})["bandwidth"] == 2_000_000


@pytest.mark.timeout(120)
def test_a_staged_loader_reads_the_batches_of_an_unstaged_one_and_the_stager_copies_the_rest(src, tmp_path):
    from shardtool.loader import ShardedLoader

    reference = read_all(ShardedLoader(src, batch_size=4, seed=2, rank=0, world_size=1, num_workers=0))
    cache_dir = str(tmp_path / "cache")
    loader = ShardedLoader(
        "faulty://" + src,
        batch_size=4,
        seed=2,
        rank=0,
        world_size=1,
        num_workers=2,
        cache_dir=cache_dir,
        storage_options={"latency": 0.01},
        stage=True,
    )
    assert read_all(loader) == reference
    fetched = loader.metrics()["cumulative"]["cache"]["fetch_bytes"]
    loader.close()
    loader._staging.process.join(30)
    assert loader._staging.process.exitcode == 0
    (path,) = glob.glob(os.path.join(cache_dir, "stage", "*", "stager-*.json"))
    with open(path) as f:
        report = json.load(f)
    assert report["status"] in ("done", "closed") and report["shards_copied"] > 0
    total = sum(info.bytes for info in loader.dataset.manifest.shards)
    assert report["bytes_copied"] + fetched == total  # each shard crossed the network once


def test_the_test_sources_bandwidth_cap_is_shared_across_instances(src, tmp_path):
    """benchmarks/staging.py relies on it: the cap is the source's, not each reader's."""
    import fsspec

    opts = {"bandwidth": 2e5, "bandwidth_file": str(tmp_path / "pipe")}
    shard = os.path.join(src, "shard-00000.tar")
    size = os.path.getsize(shard)
    readers = [fsspec.filesystem("faulty", **opts) for _ in range(2)]
    began = time.monotonic()
    threads = [threading.Thread(target=fs.cat_file, args=(shard,)) for fs in readers for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.monotonic() - began >= 4 * size / 2e5 * 0.9  # four reads through one pipe


def test_warm_follow_refuses_what_it_cannot_stage(src, tmp_path):
    import subprocess
    import sys

    from helpers.cachedata import child_env

    res = subprocess.run(
        [sys.executable, "-m", "shardtool", "warm", src, "--cache-dir", str(tmp_path / "c"), "--follow", "--all"],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 2 and "--follow stages one dataset" in res.stderr
