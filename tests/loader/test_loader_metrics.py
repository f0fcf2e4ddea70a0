"""`loader.metrics()` against ground truth computed from the dataset's own index, and the JSONL lines.

Ground truth is what a user would count by hand: the bytes of every served sample's byte range
(payload per field, from the sample index; whole ranged requests for a remote source), the
shards each process had to open, the node cache's hits and misses when half the shards are
warmed, and one metric line per ``metrics_every`` steps in a node-local file.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time

import numpy as np
import pytest

from helpers import faultfs  # noqa: F401  registers faulty://
from shardtool import cache
from shardtool.format import open_dataset
from shardtool.format.coalesce import DEFAULT_GAP, coalesce
from shardtool.loader import ShardedLoader
from shardtool.loader.observability.metricslog import default_dir, run_id
from shardtool.plan import Layout, Placement
from test_loader_data import write_dataset

pytestmark = pytest.mark.timeout(120)
SHARDS = [23, 9, 31, 0, 17, 26, 12, 20]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root, keys = write_dataset(str(tmp_path_factory.mktemp("metrics") / "d"), SHARDS, seed=5)
    ds = open_dataset(root)
    where = {}  # key -> (shard, index in shard)
    for s in range(ds.num_shards):
        for i, k in enumerate(ds.shard_index(s).keys):
            where[k] = (s, i)
    return root, ds, where


def run(loader, mid: int | None = None):
    """Every batch's keys; and the metrics after batch ``mid`` (which opens the next window)."""
    batches, at_mid = [], None
    for batch in loader:
        batches.append(list(batch["__key__"]))
        if len(batches) == mid:
            at_mid = loader.metrics()
    return batches, at_mid, loader.metrics()


def payload_bytes(ds, where, keys) -> int:
    return sum(int(ds.shard_index(s).field_sizes[i].sum()) for s, i in (where[k] for k in keys))


def opens_per_worker(where, batches, workers: int) -> int:
    """Shards each process opens: batch b is read by worker b % W (every shard stays mapped: < 64)."""
    per = [set() for _ in range(max(workers, 1))]
    for b, keys in enumerate(batches):
        per[b % max(workers, 1)].update(where[k][0] for k in keys)
    return sum(len(p) for p in per)


@pytest.mark.parametrize("workers", [0, 2])
def test_counters_match_the_index_on_a_local_dataset(data, workers, tmp_path):
    root, ds, where = data
    ld = ShardedLoader(root, batch_size=5, seed=2, num_workers=workers, pin_memory=False, metrics_dir=str(tmp_path))
    batches, mid, end = run(ld, mid=4)
    c, w = end["cumulative"], end["window"]
    keys = [k for b in batches for k in b]
    lengths = [[int(ds.lengths[ds.manifest.shard_offsets()[where[k][0]] + where[k][1]]) for k in b] for b in batches]
    assert c["batches"] == len(batches) == len(ld) and c["samples"] == len(keys)
    assert c["tokens"] == sum(map(sum, lengths)) == c["tokens_by_source"][root]
    assert c["padded_tokens"] == sum(len(x) * max(x) for x in lengths)
    assert c["bytes_read"] == {"cache": 0, "local": payload_bytes(ds, where, keys), "remote": 0}
    assert c["shard_opens"] == opens_per_worker(where, batches, workers)
    assert c["cache"]["hits"] == c["cache"]["misses"] == 0
    assert c["batches_produced"] == len(batches) and c["produce_s"] > 0
    assert 0 < c["wait_s"] <= c["seconds"] and 0 < c["wait_fraction"] <= 1
    assert c["shard_open_p50_s"] <= c["shard_open_p99_s"] < 5
    assert c["worker_starts"] == workers and c["worker_restarts"] == 0
    # The window is what happened since the call after batch 4: the two add up to the total.
    assert w["batches"] == len(batches) - 4 and mid["window"]["batches"] == 4
    assert w["bytes_read"]["local"] + mid["cumulative"]["bytes_read"]["local"] == c["bytes_read"]["local"]
    assert w["tokens"] + mid["cumulative"]["tokens"] == c["tokens"]
    assert end["rank"] == 0 and end["step"] == len(batches) and end["epoch"] == 1  # the epoch is over


@pytest.mark.parametrize("workers", [0, 2])
def test_a_remote_source_counts_its_ranged_requests(data, workers, tmp_path):
    root, ds, where = data
    ld = ShardedLoader(
        "faulty://" + root, batch_size=5, seed=2, num_workers=workers, pin_memory=False, metrics_dir=str(tmp_path)
    )
    batches, _, end = run(ld)
    c = end["cumulative"]
    # What was fetched: per batch and shard, the samples' ranges joined where neighbours lie
    # within the coalescing gap (one request each, the gaps' bytes read too).
    fetched = 0
    for b in batches:
        for s in {where[k][0] for k in b}:
            at = [where[k][1] for k in b if where[k][0] == s]
            idx = ds.shard_index(s)
            fetched += sum(end - start for start, end, _ in coalesce(idx.offsets[at], idx.sizes[at], DEFAULT_GAP))
    requested = sum(int(ds.shard_index(s).sizes[i]) for s, i in (where[k] for b in batches for k in b))
    assert fetched >= requested
    assert c["bytes_read"] == {"cache": 0, "local": 0, "remote": fetched}
    assert c["shard_opens"] == opens_per_worker(where, batches, workers)


@pytest.mark.parametrize("workers", [0, 2])
def test_half_warmed_cache_splits_hits_and_misses(data, workers, tmp_path):
    root, ds, where = data
    cdir = str(tmp_path / "cache")
    os.makedirs(tmp_path, exist_ok=True)
    report = cache.warm(root, cdir, placement=Placement(Layout(2, 1), 0), progress=False)  # node 0 of 2
    assert report.exit_code == 0, report.summary()
    dc = cache.open_cache(root, cdir)
    warmed = {s for s in range(ds.num_shards) if dc.is_cached(s)}
    assert 0 < len(warmed) < sum(1 for n in SHARDS if n)
    ld = ShardedLoader(root, batch_size=5, seed=2, num_workers=workers, pin_memory=False, cache_dir=cdir)
    batches, _, end = run(ld)
    c = end["cumulative"]
    keys = [k for b in batches for k in b]
    read = {where[k][0] for k in keys}
    cold = read - warmed
    assert c["cache"]["misses"] == len(cold)  # each cold shard fetched once, whichever worker came first
    assert c["cache"]["hits"] + c["cache"]["misses"] == c["shard_opens"] == opens_per_worker(where, batches, workers)
    assert c["cache"]["fetch_bytes"] == sum(ds.manifest.shards[s].bytes for s in cold)
    assert c["bytes_read"] == {"cache": payload_bytes(ds, where, keys), "local": 0, "remote": c["cache"]["fetch_bytes"]}
    assert ld.metrics_path.startswith(os.path.join(os.path.abspath(cdir), "metrics") + os.sep)


def test_one_metric_line_per_n_steps_in_a_node_local_file(data, tmp_path):
    root, _, _ = data
    mdir = tmp_path / "m"
    ld = ShardedLoader(
        root, batch_size=5, seed=2, num_workers=1, pin_memory=False, metrics_every=3, metrics_dir=str(mdir)
    )
    n = len(ld)
    for _ in range(2):  # two epochs: steps count on across the epoch boundary
        for _ in ld:
            pass
    lines = [json.loads(x) for x in open(ld.metrics_path)]
    assert os.listdir(mdir) == [os.path.basename(ld.metrics_path)]
    # Every 3 steps, counted across the epoch boundary, and at each pass's end: the steps after
    # the last line would otherwise be in none (their costs and step times lost).
    assert n % 3, "the epoch ends between lines"
    steps = [x["step"] for x in lines]
    assert steps == sorted({*range(3, 2 * n + 1, 3), n, 2 * n})
    assert [x["window"]["batches"] for x in lines] == np.diff([0, *steps]).tolist()
    assert sum(x["window"]["tokens"] for x in lines) == lines[-1]["cumulative"]["tokens"]
    assert {x["rank"] for x in lines} == {0} and len({x["run"] for x in lines}) == 1
    assert lines[-1]["epoch"] == 1 and lines[0]["batch"] == 3


def test_the_first_wait_counts_the_pass_plan(data, tmp_path):
    """wait_s is the time inside next(): the first one plans the pass (a remote dataset's lengths
    are read for it), and that is waiting too. A plan made slow on purpose shows in it."""
    root, _, _ = data
    ld = ShardedLoader(root, batch_size=5, num_workers=0, metrics_dir=str(tmp_path))
    plan = ld.batch_source.begin_pass

    def slow_plan():
        time.sleep(0.3)
        return plan()

    ld.batch_source.begin_pass = slow_plan  # type: ignore[method-assign]
    it = iter(ld)
    next(it)
    assert ld.metrics()["cumulative"]["wait_s"] >= 0.3
    it.close()


def test_default_metric_dir_is_node_local_and_per_run(data):
    root, _, _ = data
    ld = ShardedLoader(root, batch_size=5, num_workers=0)
    assert ld.metrics_path.startswith(os.path.join(tempfile.gettempdir(), "shardtool-metrics") + os.sep)
    env = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "TMPDIR": "/local/tmp"}
    assert run_id(env, 8, 1, 0.0) == "slurm-77.0"
    assert run_id({"TORCHELASTIC_RUN_ID": "abc"}, 8, 1, 0.0) == "torchrun-abc"
    assert (
        run_id({"TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "n1", "MASTER_PORT": "29500"}, 8, 1, 0.0)
        == "master-n1-29500"
    )
    assert run_id({}, 8, 1, 0.0) == "local"
    assert run_id({}, 1, 42, 0.0).endswith("-42")
    assert default_dir(None, None, "slurm-77.0", env) == "/local/tmp/shardtool-metrics/slurm-77.0"
    assert default_dir(None, "/nvme/c", "slurm-77.0", env) == "/nvme/c/metrics/slurm-77.0"
    assert default_dir("/x/m", "/nvme/c", "r", env) == "/x/m"


def test_metrics_off_keeps_nothing(data, tmp_path):
    root, _, _ = data
    ld = ShardedLoader(root, batch_size=5, num_workers=0, metrics=False, metrics_every=1, metrics_dir=str(tmp_path))
    assert len([b for b in ld]) == len(ld)
    with pytest.raises(RuntimeError, match="metrics=False"):
        ld.metrics()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("keyword", ["metrics", "metrics_reduce"])
def test_a_path_given_for_metrics_is_refused_not_taken_as_true(data, tmp_path, keyword):
    root, _, _ = data
    with pytest.raises(ValueError, match=f"{keyword} must be True or False .*metrics_dir"):
        ShardedLoader(root, batch_size=5, num_workers=0, **{keyword: str(tmp_path)})
    assert os.listdir(tmp_path) == []


def test_cold_cache_warns_before_the_first_batch(data, tmp_path, caplog):
    root, ds, _ = data
    cdir = str(tmp_path / "cold")
    caplog.set_level(logging.WARNING, logger="shardtool.loader")
    ld = ShardedLoader(root, batch_size=5, num_workers=0, cache_dir=cdir, metrics_dir=str(tmp_path))
    it = iter(ld)
    next(it)
    behind = [r for r in caplog.records if "node cache is behind the plan" in r.getMessage()]
    assert len(behind) == 1 and "shard-0000" in behind[0].getMessage()
    assert ld.metrics()["cache_behind_shards"] > 0
    caplog.clear()
    list(it)  # the rest: every shard is now fetched
    warm_ld = ShardedLoader(root, batch_size=5, num_workers=0, cache_dir=cdir, metrics_dir=str(tmp_path))
    list(warm_ld)
    assert not [r for r in caplog.records if "behind the plan" in r.getMessage()]
    assert warm_ld.metrics()["cache_behind_shards"] == 0


def test_a_pass_continued_after_an_error_counts_its_worker_restarts(data, tmp_path):
    root, _, where = data
    flag = tmp_path / "failed-once"
    target = sorted(where)[40]

    def fail_once(sample):
        if sample["__key__"] == target and not flag.exists():
            flag.touch()
            raise ValueError(f"injected failure on {target}")
        return sample

    ld = ShardedLoader(
        root, batch_size=5, seed=2, num_workers=2, transform=fail_once, pin_memory=False, metrics_dir=str(tmp_path)
    )
    n, got = len(ld), []
    with pytest.raises(Exception, match="injected failure"):
        for b in ld:
            got.append(b)
    got += list(ld)  # the same epoch goes on where it stopped, with fresh workers
    c = ld.metrics()["cumulative"]
    assert len(got) == n == c["batches"]
    assert c["worker_starts"] == 4 and c["worker_restarts"] == 2


def test_metrics_reduce_without_a_process_group_says_so_once(data, tmp_path, caplog):
    root, _, _ = data
    caplog.set_level(logging.WARNING, logger="shardtool.loader")
    ld = ShardedLoader(
        root, batch_size=5, num_workers=0, metrics_every=2, metrics_reduce=True, metrics_dir=str(tmp_path)
    )
    list(ld)
    said = [r for r in caplog.records if "metrics_reduce needs" in r.getMessage()]
    assert len(said) == 1 and ld.rank_summary is None


@pytest.mark.parametrize("fmt", ["tar", "arrow"])
@pytest.mark.parametrize("extra", [True, False])
def test_every_read_path_counts_the_same_bytes(fmt, extra, tmp_path):
    # The token gather counts a token-only shard from its element counts (the rest of a sample,
    # an npy header, is the same for all), other shards and the sample-by-sample path (any
    # transform) from the views: the same samples must give the same bytes, in either format.
    root, _ = write_dataset(str(tmp_path / fmt), [23, 9, 31], fmt=fmt, seed=8, extra=extra)
    got = set()
    for kw in ({}, {"transform": lambda s: s}, {"num_workers": 2}):
        ld = ShardedLoader(
            root, batch_size=5, seed=2, pin_memory=False, metrics_dir=str(tmp_path), **{"num_workers": 0, **kw}
        )
        list(ld)
        c = ld.metrics()["cumulative"]
        got.add((c["bytes_read"]["local"], c["samples"]))
    assert len(got) == 1 and next(iter(got))[0] > 0


def test_open_latency_percentiles_come_from_a_log_histogram():
    from shardtool.loader.observability import probe

    hist = np.zeros(probe.HIST_BUCKETS)
    for seconds, times in ((0.001, 98), (1.0, 2)):
        hist[probe.bucket(seconds)] += times
    p50, p99 = probe.percentiles(hist, (0.5, 0.99))
    step = 2 ** (1 / probe.HIST_PER_OCTAVE)  # the bucket width: the resolution promised
    assert 0.001 / step <= p50 <= 0.001 * step and 1.0 / step <= p99 <= 1.0 * step
    assert probe.percentiles(np.zeros(probe.HIST_BUCKETS), (0.5,)) == [None]
