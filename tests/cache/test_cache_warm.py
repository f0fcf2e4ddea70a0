"""warm(): exactly the node's shards, verified and atomic; trust, budget, retries and faults."""

import os
import subprocess
import time

import pytest

from helpers import faultfs  # noqa: F401  registers faulty://
from helpers.cachedata import make_dataset
from helpers.fsutil import flip_byte, temps, tmpfs
from shardtool.cache import RetryPolicy, VersionDir, assigned_shards, open_cache, warm
from shardtool.cache.store import temp_path_for
from shardtool.format import open_dataset
from shardtool.plan import Layout, Placement

FAST = RetryPolicy(attempts=4, base_delay=0.01, max_delay=0.05, attempt_timeout=10, stall_timeout=0.5)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_dataset(str(tmp_path_factory.mktemp("src") / "ds"), shards=10, samples=8, sample_bytes=2000)


def cached_files(report):
    ds = open_dataset(report.version_dir)
    return {i for i, s in enumerate(ds.manifest.shards) if os.path.exists(os.path.join(report.version_dir, s.path))}


def test_warm_copies_exactly_the_nodes_shards_and_rerun_skips(src, tmp_path):
    ds = open_dataset(src)
    for node in range(3):
        r = warm(src, str(tmp_path / f"n{node}"), placement=Placement(Layout(3, 1), node))
        want = assigned_shards(ds.summaries, Placement(Layout(3, 1), node))
        assert r.status == "ok" and r.exit_code == 0
        assert cached_files(r) == set(want) and r.shards_copied == len(want)
        again = warm(src, str(tmp_path / f"n{node}"), placement=Placement(Layout(3, 1), node))
        assert again.shards_copied == 0 and again.shards_skipped == len(want)
        # the version dir is itself a dataset root: read every sample of the node's shards
        local = open_dataset(r.version_dir)
        assert local.version == ds.version
        for i in want:
            assert local.read(i, 0) == ds.read(i, 0)


def test_flipped_byte_and_truncation_are_detected_and_refetched(src, tmp_path):
    r = warm(src, str(tmp_path), all_shards=True)
    vd = VersionDir(str(tmp_path), r.version)
    m = open_dataset(src).manifest
    p0, p1 = vd.path(m.shards[0].path), vd.path(m.shards[1].path)
    flip_byte(p0, 100)
    with open(p1, "r+b") as f:
        f.truncate(m.shards[1].bytes - 7)
    assert not vd.trusted(0, m.shards[0]) and not vd.trusted(1, m.shards[1])
    again = warm(src, str(tmp_path), all_shards=True)
    assert again.shards_copied == 2 and again.status == "ok"
    assert open_dataset(again.version_dir).read(0, 0) == open_dataset(src).read(0, 0)


def test_flip_that_keeps_size_and_mtime_is_caught_by_verify(src, tmp_path):
    r = warm(src, str(tmp_path), all_shards=True)
    m = open_dataset(src).manifest
    p = VersionDir(str(tmp_path), r.version).path(m.shards[2].path)
    st = os.stat(p)
    with open(p, "r+b") as f:
        f.write(b"X")
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert warm(src, str(tmp_path), all_shards=True, verify=True).shards_copied == 1


def test_rerun_over_complete_cache_of_1000_shards_is_fast(tmp_path):
    src = make_dataset(str(tmp_path / "big"), shards=1000, samples=1, sample_bytes=64, replicate=True)
    first = warm(src, str(tmp_path / "c"), all_shards=True, jobs=8)
    assert first.shards_copied == 1000
    began = time.perf_counter()
    again = warm(src, str(tmp_path / "c"), all_shards=True, jobs=8)
    took = time.perf_counter() - began
    assert again.shards_copied == 0 and again.shards_skipped == 1000
    assert took < 2.0, f"rerun took {took:.2f}s"  # ~0.2 s here; generous for a loaded CI box


def test_stale_lock_and_temp_from_a_dead_holder_are_recovered(src, tmp_path):
    ds = open_dataset(src)
    vd = VersionDir(str(tmp_path), ds.version)
    lock = vd.lock_path(0)
    os.makedirs(os.path.dirname(lock), exist_ok=True)
    # A process takes the shard's lock and leaves a temp, then dies by SIGKILL.
    holder = subprocess.Popen(
        [
            "python3",
            "-c",
            f"import fcntl,time;f=open({lock!r},'w');fcntl.flock(f,fcntl.LOCK_EX);"
            "print('locked',flush=True);time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "locked"
    final = vd.path(ds.manifest.shards[0].path)
    os.makedirs(os.path.dirname(final), exist_ok=True)
    with open(temp_path_for(final), "wb") as f:
        f.write(b"partial")
    holder.kill()
    holder.wait(10)
    r = warm(src, str(tmp_path), all_shards=True, timeout=20)
    assert r.status == "ok" and r.shards_copied == ds.num_shards
    assert temps(r.version_dir) == []


def test_budget_too_small_is_a_local_fault_naming_the_need(src, tmp_path):
    ds = open_dataset(src)
    r = warm(src, str(tmp_path), placement=Placement(Layout(2, 1), 0), max_bytes=ds.manifest.num_bytes // 10)
    assert r.status == "local_fault" and r.exit_code == 3
    assert "need" in r.error and "bytes" in r.error
    be = warm(
        src, str(tmp_path), placement=Placement(Layout(2, 1), 0), max_bytes=ds.manifest.num_bytes // 5, best_effort=True
    )
    assert be.exit_code == 0 and be.status == "partial" and be.not_fitted and be.warnings
    assert be.shards_copied + len(be.not_fitted) == be.assigned
    assert sum(ds.manifest.shards[i].bytes for i in cached_files(be)) <= ds.manifest.num_bytes // 5


def test_eviction_removes_unassigned_shards_first(src, tmp_path):
    ds = open_dataset(src)
    full = warm(src, str(tmp_path), all_shards=True)
    assert full.shards_copied == ds.num_shards
    mine = set(assigned_shards(ds.summaries, Placement(Layout(2, 1), 1)))
    budget = sum(ds.manifest.shards[i].bytes for i in mine) + 10
    r = warm(src, str(tmp_path), placement=Placement(Layout(2, 1), 1), max_bytes=budget)
    assert r.status == "ok" and r.shards_copied == 0 and r.evicted_shards > 0
    assert mine <= cached_files(r)
    assert sum(ds.manifest.shards[i].bytes for i in cached_files(r)) <= budget


def test_reading_keeps_a_shard_from_eviction(src, tmp_path):
    from shardtool.cache import admin

    warm(src, str(tmp_path), all_shards=True)
    c = open_cache(src, str(tmp_path))
    with c.reading(3) as path:
        res = admin.gc(str(tmp_path), max_bytes=0)
        assert os.path.exists(path)
        assert res["evicted_shards"] == c.dataset.num_shards - 1
    assert admin.gc(str(tmp_path), max_bytes=0)["evicted_shards"] == 1


def test_transient_errors_short_reads_and_stalls_are_retried(src, tmp_path):
    m = open_dataset(src).manifest
    url = "faulty://" + src
    opts = {
        "transient": {m.shards[0].path: 2, "index.json": 1},
        "short": {m.shards[1].path: 1},
        "stall": {m.shards[2].path: [3.0, 1]},
    }
    r = warm(url, str(tmp_path), all_shards=True, retry=FAST, storage_options=opts)
    assert r.status == "ok", r.error
    assert r.shards_copied == len(m.shards)
    assert r.retries >= 4  # 2 transient + 1 short + 1 stall (the index.json retry is not a shard retry)
    assert temps(r.version_dir) == []


def test_missing_source_shard_fails_naming_the_shard(src, tmp_path):
    m = open_dataset(src).manifest
    bad = m.shards[4].path
    r = warm(
        "faulty://" + src, str(tmp_path), all_shards=True, retry=FAST, strict=True, storage_options={"missing": [bad]}
    )
    assert r.status == "remote_failed" and r.exit_code == 1
    assert r.shards_failed == 1 and bad in r.error and "404" in r.error
    assert r.shards_copied == len(m.shards) - 1
    lax = warm(
        "faulty://" + src, str(tmp_path / "lax"), all_shards=True, retry=FAST, storage_options={"missing": [bad]}
    )
    assert lax.exit_code == 0 and lax.status == "remote_failed"


def test_missing_shard_gets_exactly_one_request(src, tmp_path):
    import fsspec

    from shardtool.cache.errors import SourceMissing
    from shardtool.cache.meta import ensure_shard
    from shardtool.cache.store import Origin

    ds = open_dataset(src)
    fs = fsspec.filesystem("faulty", missing=[ds.manifest.shards[4].path])
    source = Origin("faulty://" + src, fs=fs, root=src)
    vd = VersionDir(str(tmp_path), ds.version)
    with pytest.raises(SourceMissing, match=ds.manifest.shards[4].path):
        ensure_shard(vd, 4, ds.manifest.shards[4], source, policy=FAST)
    assert fs.requests[ds.shard_path(4)] == 1


def test_corrupt_source_shard_is_named_and_never_published(src, tmp_path):
    import shutil

    bad_src = str(tmp_path / "bad")
    shutil.copytree(src, bad_src)
    m = open_dataset(bad_src).manifest
    with open(os.path.join(bad_src, m.shards[5].path), "r+b") as f:
        f.seek(600)
        f.write(b"\x00\x01\x02")
    r = warm(bad_src, str(tmp_path / "c"), all_shards=True, retry=FAST, strict=True)
    assert r.exit_code == 1 and m.shards[5].path in r.error and "corrupt" in r.error
    assert 5 not in cached_files(r) and temps(r.version_dir) == []


def test_unreachable_source_is_remote_not_local(tmp_path, src):
    r = warm("faulty://" + src, str(tmp_path), all_shards=True, retry=FAST, storage_options={"refuse": True})
    assert r.status == "remote_failed" and r.exit_code == 0
    r = warm(
        "faulty://" + src, str(tmp_path), all_shards=True, retry=FAST, storage_options={"refuse": True}, strict=True
    )
    assert r.exit_code == 1


def test_read_only_or_missing_cache_dir_is_a_local_fault(src, tmp_path):
    r = warm(src, str(tmp_path / "no" / "such" / "dir"), all_shards=True)
    assert r.status == "local_fault" and r.exit_code == 3 and "missing" in r.error
    with tmpfs(tmp_path / "ro", "ro,size=1m") as mnt:
        r = warm(src, str(mnt), all_shards=True)
        assert r.status == "local_fault" and r.exit_code == 3 and "not writable" in r.error
