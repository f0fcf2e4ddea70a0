"""`shardtool.cache.warm` when the source is gone or down: a node whose cache holds a complete version
for the URL succeeds with a warning (status `cached`, exit 0) and the loader opens that version; an
incomplete cache leaves the error as it was (no dataset: a usage error; an outage: a remote failure)."""

import os
import shutil

import pytest

from helpers import faultfs  # noqa: F401  (registers faulty://)
from helpers.cachedata import make_dataset
from shardtool.cache import RetryPolicy, open_cache, warm
from shardtool.plan import Layout, Placement

QUICK = RetryPolicy(attempts=1, attempt_timeout=5, stall_timeout=5)


@pytest.fixture
def src(tmp_path):
    return make_dataset(str(tmp_path / "ds"), shards=6, samples=4, sample_bytes=4_000)


@pytest.mark.timeout(120)
def test_moved_source_served_from_a_complete_cache(src, tmp_path):
    cache = str(tmp_path / "cache")
    node0 = Placement(Layout(2, 1), 0)
    first = warm(src, cache, placement=node0)
    assert first.status == "ok" and first.shards_copied == first.assigned > 0
    shutil.move(src, src + ".moved")
    again = warm(src, cache, placement=node0)
    assert again.status == "cached" and again.exit_code == 0 and again.version == first.version
    assert again.shards_skipped == first.assigned and "has no manifest any more" in again.warnings[0]
    dc = open_cache(src, cache)  # the loader's view: that version, offline
    held = [i for i in range(6) if dc.is_cached(i)]
    assert dc.version == first.version and len(held) == first.assigned
    assert all(os.path.getsize(dc.local_shard(i)) == dc.manifest.shards[i].bytes for i in held)
    # the other node's share was never warmed here: not complete for it, the mistake stays one
    other = warm(src, cache, placement=Placement(Layout(2, 1), 1))
    assert other.status == "usage_error" and other.exit_code == 2


@pytest.mark.timeout(120)
def test_source_down_served_from_a_complete_cache(src, tmp_path):
    cache = str(tmp_path / "cache")
    assert warm(src, cache).status == "ok"
    down = warm("faulty://" + src, cache, retry=QUICK, storage_options={"refuse": True})
    # another URL string for the same data is another record: nothing cached for it, an outage
    assert down.status == "remote_failed" and down.exit_code == 0
    cache2 = str(tmp_path / "cache2")
    assert warm("faulty://" + src, cache2, retry=QUICK).status == "ok"
    down = warm("faulty://" + src, cache2, retry=QUICK, storage_options={"refuse": True})
    assert down.status == "cached" and "cannot be reached" in down.warnings[0], down
    os.unlink(next(p for p in (tmp_path / "cache2").rglob("*.tar")))
    down = warm("faulty://" + src, cache2, retry=QUICK, storage_options={"refuse": True})
    assert down.status == "remote_failed"
