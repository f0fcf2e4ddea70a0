"""Faults on the cache side: a full disk, cached files damaged at rest, warmers killed or racing,
stale locks, and eviction under pressure while other real processes read."""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from helpers.cachedata import child_env, make_dataset
from helpers.fsutil import flip_byte, temps, tmpfs
from shardtool.cache import VersionDir, admin, assigned_shards, open_cache, warm
from shardtool.cache.errors import CacheError, NotCached
from shardtool.format import open_dataset
from shardtool.format.hashing import hash_file
from shardtool.plan import Layout, Placement
from test_storage_faults import FAST, corrupt  # also registers edgefaulty://

FAULTS = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(FAULTS)
REPO = os.path.dirname(TESTS)

# A warm in its own process, over edgefaulty:// (so it can be slowed and its opens logged).
WARM = r"""
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import test_storage_faults
from shardtool.cache import RetryPolicy, store, warm
a = json.loads(sys.argv[3])
store.CHUNK = a.get("chunk", store.CHUNK)
r = warm(a["url"], a["cache"], all_shards=True, jobs=a.get("jobs", 2), storage_options=a.get("opts"),
         retry=RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.05, stall_timeout=30))
print(json.dumps(r.to_dict()), flush=True)
"""

# Holds DatasetCache.reading(i) on the given shards until stdin closes (or reads in a loop).
READER = r"""
import contextlib, json, sys, time
sys.path[:0] = [sys.argv[1]]
from shardtool.cache import open_cache
from shardtool.format.hashing import hash_file
a = json.loads(sys.argv[2])
c = open_cache(a["url"], a["cache"])
if a["mode"] == "hold":
    with contextlib.ExitStack() as st:
        for i in a["shards"]:
            st.enter_context(c.reading(i))
        print("holding", flush=True)
        sys.stdin.readline()
else:
    end, n = time.monotonic() + a["seconds"], 0
    while time.monotonic() < end:
        for i in a["shards"]:
            with c.reading(i) as path:
                h = hash_file(path)[0]
                if h != c.manifest.shards[i].hash:
                    print(json.dumps({"bad": i}), flush=True)
                    sys.exit(1)
                n += 1
    print(json.dumps({"reads": n}), flush=True)
"""


def spawn(script, *args, **kw):
    return subprocess.Popen([sys.executable, "-c", script, *args], env=child_env(), text=True, **kw)


def hold(url, cache_dir, shards):
    p = spawn(
        READER,
        REPO,
        json.dumps({"url": url, "cache": cache_dir, "mode": "hold", "shards": shards}),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert p.stdout.readline().strip() == "holding"
    return p


def release(p):
    p.stdin.close()
    assert p.wait(30) == 0


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_dataset(str(tmp_path_factory.mktemp("src") / "ds"), shards=8, samples=6, sample_bytes=4000)


def cached(cache_dir, ds):
    vd = VersionDir(cache_dir, ds.version)
    return {i for i, s in enumerate(ds.manifest.shards) if os.path.exists(vd.path(s.path))}


# --------------------------------------------------------------------------- disk full
@pytest.mark.timeout(60)
def test_disk_full_during_warm_and_fetch_on_miss(tmp_path):
    src = make_dataset(str(tmp_path / "src"), shards=5, samples=4, sample_bytes=200_000)  # ~0.8 MB a shard
    m = open_dataset(src).manifest
    with tmpfs(tmp_path / "tiny", "size=2m") as mnt:
        r = warm(src, str(mnt / "c"), all_shards=True, jobs=2, retry=FAST)
        assert r.status == "local_fault" and r.exit_code == 3
        # names the file that did not fit: a shard, or a sample index copied alongside the shards
        assert "No space left" in r.error and any(s.path in r.error or s.index in r.error for s in m.shards), r.error
        vd = VersionDir(str(mnt / "c"), r.version)
        for i, s in enumerate(m.shards):  # nothing truncated published, nothing half trusted
            if os.path.exists(vd.path(s.path)):
                # intact; maybe without its stamp (the disk filled up right after the rename),
                # which only means it is hashed again before use
                assert hash_file(vd.path(s.path))[0] == s.hash
            else:
                assert not vd.trusted(i, s)
        assert temps(vd.root) == []
        # the loader's fetch-on-miss into the same full disk: a clear error naming the shard
        c = open_cache(src, str(mnt / "c"), retry=FAST)
        missing = [i for i in range(len(m.shards)) if not c.is_cached(i)]
        with pytest.raises(CacheError, match="No space left") as ei:
            for i in missing:
                c.local_shard(i)
        assert any(m.shards[i].path in str(ei.value) for i in missing)
        assert temps(vd.root) == []


# --------------------------------------------------------------------------- damaged at rest
@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["truncate", "flip"])
def test_a_damaged_cached_shard_is_never_served_and_is_refetched(src, tmp_path, how):
    ds = open_dataset(src)
    cache_dir = str(tmp_path / "c")
    r = warm("edgefaulty://" + src, cache_dir, all_shards=True)
    vd = VersionDir(cache_dir, r.version)
    rng = random.Random(11)
    victims = rng.sample(range(ds.num_shards), 3)
    for i in victims:
        corrupt(vd.path(ds.manifest.shards[i].path), how, rng)
        assert not vd.trusted(i, ds.manifest.shards[i])
    # the loader-facing path: with the source gone it refuses, naming the shard, never serves it
    c = open_cache("edgefaulty://" + src, cache_dir, storage_options={"refuse": True}, retry=FAST)
    for i in victims:
        with pytest.raises(NotCached, match=ds.manifest.shards[i].path):
            c.local_shard(i)
        with pytest.raises(NotCached, match=ds.manifest.shards[i].path):
            c.dataset.read(i, 0)
    # with the source back it refetches, and every sample is right
    c = open_cache(src, cache_dir)
    for i in victims:
        assert hash_file(c.local_shard(i))[0] == ds.manifest.shards[i].hash
        assert c.dataset.read(i, 5) == ds.read(i, 5)
    # and the next warm finds them good: nothing copied
    assert warm(src, cache_dir, all_shards=True).shards_copied == 0


@pytest.mark.timeout(60)
def test_a_flip_that_keeps_size_and_mtime(src, tmp_path):
    ds = open_dataset(src)
    cache_dir = str(tmp_path / "c")
    warm(src, cache_dir, all_shards=True)
    vd = VersionDir(cache_dir, ds.version)
    info = ds.manifest.shards[3]
    p = vd.path(info.path)
    st = os.stat(p)
    time.sleep(0.02)  # a ctime tick on coarse clocks
    flip_byte(p, 700, 4)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.path.getsize(p) == info.bytes and os.stat(p).st_mtime_ns == st.st_mtime_ns
    # The trust stamp records ctime too, which no utime can set back: the cheap check catches it.
    assert not vd.trusted(3, info)
    c = open_cache(src, cache_dir)
    assert hash_file(c.local_shard(3))[0] == info.hash
    # `cache verify` (and `warm --verify`) hash every byte, whatever the stat says.
    with open(p, "r+b") as f:
        f.write(b"X")
    res = admin.verify(cache_dir)
    assert res["bad"] == [p] and not os.path.exists(p)
    assert warm(src, cache_dir, all_shards=True, verify=True).shards_copied == 1


# --------------------------------------------------------------------------- killed and racing warmers
@pytest.mark.timeout(90)
def test_warmer_killed_mid_copy_leaves_no_final_file_and_recovery_is_automatic(src, tmp_path):
    ds = open_dataset(src)
    info = ds.manifest.shards[0]
    cache_dir = str(tmp_path / "c")
    vd = VersionDir(cache_dir, ds.version)
    final = vd.path(info.path)
    # shard 0 in two reads, each taking 1.5 s: the first half lands in the temp, the second stalls
    opts = {"stall": {info.path: [1.5, 1000]}}
    args = {"url": "edgefaulty://" + src, "cache": cache_dir, "jobs": 1, "opts": opts, "chunk": info.bytes // 2 + 1}
    p = spawn(WARM, FAULTS, TESTS, json.dumps(args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            half = [t for t in temps(vd.root) if info.path.rsplit("/", 1)[-1] in t and os.path.getsize(t) > 0]
            if half:
                break
            time.sleep(0.02)
        else:
            pytest.fail("the warmer never wrote shard 0's temp")
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    assert not os.path.exists(final) and not vd.trusted(0, info)
    assert temps(vd.root)  # the dead writer's temp is left behind...
    c = open_cache(src, cache_dir)  # ...and the loader recovers: lock died with it, temp removed
    assert hash_file(c.local_shard(0))[0] == info.hash
    r = warm(src, cache_dir, all_shards=True)
    assert r.status == "ok" and temps(vd.root) == []


@pytest.mark.timeout(90)
def test_two_warmers_on_the_same_shards_read_and_publish_each_once(src, tmp_path):
    ds = open_dataset(src)
    cache_dir = str(tmp_path / "c")
    log = str(tmp_path / "opens.log")
    args = json.dumps(
        {"url": "edgefaulty://" + src, "cache": cache_dir, "jobs": 4, "opts": {"latency": 0.1, "log": log}}
    )
    procs = [spawn(WARM, FAULTS, TESTS, args, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    reports = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        reports.append(json.loads(out))
    assert all(r["status"] == "ok" for r in reports)
    assert sum(r["shards_copied"] for r in reports) == ds.num_shards  # one publish per shard
    opens = collections.Counter(line.split(" ", 1)[1].strip() for line in open(log))
    assert opens == {ds.shard_path(i): 1 for i in range(ds.num_shards)}  # one source read per shard
    for i, s in enumerate(ds.manifest.shards):
        assert hash_file(VersionDir(cache_dir, ds.version).path(s.path))[0] == s.hash


@pytest.mark.timeout(60)
def test_stale_lock_of_a_killed_fetcher_is_recovered(src, tmp_path):
    ds = open_dataset(src)
    cache_dir = str(tmp_path / "c")
    info = ds.manifest.shards[2]
    args = {"url": "edgefaulty://" + src, "cache": cache_dir, "jobs": 1, "opts": {"stall": {info.path: [60, 1]}}}
    p = spawn(WARM, FAULTS, TESTS, json.dumps(args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    vd = VersionDir(cache_dir, ds.version)
    try:
        deadline = time.monotonic() + 30
        while not (os.path.exists(vd.lock_path(2)) and temps(vd.root)) and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    assert os.path.exists(vd.lock_path(2))  # the lock file stays; the lock died with its holder
    began = time.monotonic()
    r = warm(src, cache_dir, all_shards=True, timeout=20)
    assert r.status == "ok" and time.monotonic() - began < 10 and temps(vd.root) == []
    assert hash_file(vd.path(info.path))[0] == info.hash


# --------------------------------------------------------------------------- eviction pressure
@pytest.mark.timeout(60)
def test_shards_read_by_another_process_are_never_evicted(src, tmp_path):
    ds = open_dataset(src)
    cache_dir = str(tmp_path / "c")
    warm(src, cache_dir, all_shards=True)
    held = [1, 4, 6]
    p = hold(src, cache_dir, held)
    try:
        res = admin.gc(cache_dir, max_bytes=0)
        assert cached(cache_dir, ds) == set(held)
        assert res["evicted_shards"] == ds.num_shards - len(held)
        cleared = admin.clear(cache_dir)
        assert sorted(cleared["busy"]) == sorted(
            VersionDir(cache_dir, ds.version).path(ds.manifest.shards[i].path) for i in held
        )
        assert cached(cache_dir, ds) == set(held)
    finally:
        release(p)
    assert admin.gc(cache_dir, max_bytes=0)["evicted_shards"] == len(held)


@pytest.mark.timeout(60)
def test_readers_in_other_processes_keep_reading_while_the_cache_is_evicted(src, tmp_path):
    ds = open_dataset(src)
    cache_dir = str(tmp_path / "c")
    warm(src, cache_dir, all_shards=True)
    readers = [
        spawn(
            READER,
            REPO,
            json.dumps(
                {
                    "url": src,
                    "cache": cache_dir,
                    "mode": "loop",
                    "seconds": 3,
                    "shards": list(range(k, ds.num_shards, 2)),
                }
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for k in range(2)
    ]
    evicted = 0
    while any(r.poll() is None for r in readers):
        evicted += admin.gc(cache_dir, max_bytes=ds.manifest.shards[0].bytes)["evicted_shards"]
        time.sleep(0.01)
    for r in readers:
        out, err = r.communicate(timeout=30)
        assert r.returncode == 0, out + err
        assert json.loads(out)["reads"] > 0
    assert evicted > 0  # the pressure was real: readers refetched what was evicted under them


@pytest.mark.timeout(60)
def test_budget_below_the_working_set_in_use_is_a_clear_error(src, tmp_path):
    ds = open_dataset(src)
    cache_dir = str(tmp_path / "c")
    held = [0, 1, 2]
    warm(src, cache_dir, all_shards=True)
    admin.gc(cache_dir, max_bytes=0)  # empty it
    p = hold(src, cache_dir, held)  # fetched on a miss and held
    try:
        in_use = sum(ds.manifest.shards[i].bytes for i in held)
        c = open_cache(src, cache_dir, max_bytes=in_use + 10)
        with pytest.raises(CacheError, match=ds.manifest.shards[5].path) as ei:
            c.local_shard(5)
        assert "budget" in str(ei.value)
        assert cached(cache_dir, ds) == set(held)  # nothing evicted, nothing fetched over budget
        # a warm of another node's shards: the plan would evict the held (unassigned) shards, but
        # they are in use, so the budget cannot be met
        mine = assigned_shards(ds.summaries, Placement(Layout(2, 1), 1))
        assert not set(mine) & set(held)
        budget = sum(ds.manifest.shards[i].bytes for i in mine) + 10
        r = warm(src, cache_dir, placement=Placement(Layout(2, 1), 1), max_bytes=budget)
        assert r.status == "local_fault" and r.exit_code == 3 and "budget" in r.error and "in use" in r.error
        assert cached(cache_dir, ds) == set(held)
        be = warm(src, cache_dir, placement=Placement(Layout(2, 1), 1), max_bytes=budget, best_effort=True)
        assert be.status == "partial" and be.not_fitted
        assert (
            sum(
                os.path.getsize(VersionDir(cache_dir, ds.version).path(ds.manifest.shards[i].path))
                for i in cached(cache_dir, ds)
            )
            <= budget
        )
        assert set(held) <= cached(cache_dir, ds)
    finally:
        release(p)
    # readers gone: the same warm now fits by evicting what they held
    r = warm(src, cache_dir, placement=Placement(Layout(2, 1), 1), max_bytes=budget)
    assert r.status == "ok" and cached(cache_dir, ds) == set(mine)
