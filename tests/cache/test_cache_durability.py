"""Publishing without an fsync, and what a reboot does to trust (cache/durability.py).

A machine crash cannot be staged in a test; what it leaves behind can: a shard whose bytes were
lost while its stamp (written in the earlier boot) still matches the file's stat. These tests
write exactly that state to real files and check that nothing reads the lost bytes.
"""

import json
import os

import pytest

from helpers.cachedata import make_dataset
from helpers.skips import require
from shardtool.cache import VersionDir, open_cache, warm
from shardtool.cache.durability import boot_id
from shardtool.format import open_dataset
from shardtool.format.hashing import hash_file


@pytest.fixture(autouse=True)
def _needs_boot_id():
    require(boot_id() is not None, "no kernel boot id here (/proc/sys/kernel/random/boot_id): every shard is fsynced")


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_dataset(str(tmp_path_factory.mktemp("src") / "ds"), shards=4, samples=6, sample_bytes=3000)


def stamp(vd, i):
    with open(vd.stamp_path(i)) as f:
        return json.load(f)


def restamp(vd, i, **fields):
    """Rewrite shard i's stamp to the file's current stat, with ``fields`` changed."""
    st = os.stat(vd.path(open_dataset(vd.root).manifest.shards[i].path))
    body = {
        **stamp(vd, i),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "ino": st.st_ino,
        **fields,
    }
    with open(vd.stamp_path(i), "w") as f:
        json.dump(body, f)


def lose_bytes_in_a_crash(path):
    """What a crash before writeback can leave: the right size, but zeros where data was."""
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.write(bytes(size))


def test_default_warm_publishes_unsynced_and_says_so(src, tmp_path):
    r = warm(src, str(tmp_path), all_shards=True)
    assert r.status == "ok" and r.durable is False and r.to_dict()["durable"] is False
    vd = VersionDir(str(tmp_path), r.version)
    for i in range(4):
        assert stamp(vd, i)["boot"] == boot_id() and stamp(vd, i)["durable"] is False
        assert vd.trusted(i, open_dataset(src).manifest.shards[i])  # same boot: the page cache is the truth


def test_durable_warm_stamps_fsynced_shards(src, tmp_path):
    r = warm(src, str(tmp_path), all_shards=True, durable=True)
    assert r.status == "ok" and r.durable is True
    vd = VersionDir(str(tmp_path), r.version)
    assert all(stamp(vd, i)["durable"] is True for i in range(4))


def test_bytes_lost_in_a_crash_are_never_served_and_are_refetched(src, tmp_path):
    ds = open_dataset(src)
    r = warm(src, str(tmp_path), all_shards=True)
    vd = VersionDir(str(tmp_path), r.version)
    lost = vd.path(ds.manifest.shards[1].path)
    lose_bytes_in_a_crash(lost)
    restamp(vd, 1, boot="an-earlier-boot")  # the stamp matches the file's stat, as after the crash
    restamp(vd, 2, boot="an-earlier-boot")  # this one's bytes survived
    assert not vd.trusted(1, ds.manifest.shards[1]) and not vd.trusted(2, ds.manifest.shards[2])

    c = open_cache(src, str(tmp_path))  # the loader's path re-hashes before serving
    assert hash_file(c.local_shard(1))[0] == ds.manifest.shards[1].hash
    again = warm(src, str(tmp_path), all_shards=True)
    assert again.status == "ok" and again.shards_copied == 0  # shard 1 was refetched by the loader above
    # the survivor was re-hashed, not refetched, and fsynced: its new stamp outlives reboots
    assert stamp(vd, 2)["durable"] is True and stamp(vd, 2)["boot"] == boot_id()

    lose_bytes_in_a_crash(lost)
    restamp(vd, 1, boot="an-earlier-boot", durable=False)
    r3 = warm(src, str(tmp_path), all_shards=True)  # the prolog's path: refetched, nothing lost served
    assert r3.status == "ok" and r3.shards_copied == 1
    assert hash_file(lost)[0] == ds.manifest.shards[1].hash


def test_fsynced_shards_stay_trusted_across_a_reboot_without_rehashing(src, tmp_path):
    ds = open_dataset(src)
    r = warm(src, str(tmp_path), all_shards=True, durable=True)
    vd = VersionDir(str(tmp_path), r.version)
    for i in range(4):
        restamp(vd, i, boot="an-earlier-boot")
    before = [stamp(vd, i) for i in range(4)]
    again = warm(src, str(tmp_path), all_shards=True)
    assert again.shards_copied == 0 and again.shards_skipped == 4
    assert [stamp(vd, i) for i in range(4)] == before  # trusted by stat alone: not re-hashed, not restamped
    assert all(vd.trusted(i, s) for i, s in enumerate(ds.manifest.shards))


def test_stamps_from_before_boot_ids_were_recorded_count_as_fsynced(src, tmp_path):
    ds = open_dataset(src)
    r = warm(src, str(tmp_path), all_shards=True)
    vd = VersionDir(str(tmp_path), r.version)
    body = stamp(vd, 0)
    del body["boot"], body["durable"]  # what the first release wrote, always after an fsync
    with open(vd.stamp_path(0), "w") as f:
        json.dump(body, f)
    assert vd.trusted(0, ds.manifest.shards[0])
