"""Faults at the storage edge, seen by the warmer and by remote reads without a cache.

Faults are injected by a wrapping fsspec filesystem (``faulty://`` from tests/helpers/faultfs.py, plus
``edgefaulty://`` below for the faults it lacks: a bit flipped in transit, a 503, a log of
opens shared across processes), over a local directory or a real moto S3 server; our own code
is never mocked. Every error must name the shard.
"""

from __future__ import annotations

import collections
import errno
import os
import random
import shutil
import time

import fsspec
import pytest

from helpers import faultfs
from helpers.cachedata import make_dataset
from helpers.fsutil import flip_byte, temps
from helpers.s3server import s3_server  # noqa: F401  (fixture)
from shardtool.cache import RetryPolicy, VersionDir, open_cache, warm
from shardtool.cache.errors import NotCached
from shardtool.format import open_dataset
from shardtool.format.errors import ShardtoolError
from shardtool.format.hashing import hash_file

FAST = RetryPolicy(attempts=4, base_delay=0.01, max_delay=0.05, attempt_timeout=10, stall_timeout=0.5)


# --------------------------------------------------------------------------- the fault edge
class EdgeFS(faultfs.FaultyFileSystem):
    """faultfs plus: ``flip`` {substring: k} (the first k opens return one bit flipped mid-file),
    ``http503`` {substring: k} (the first k requests fail as s3fs reports a 503 it gave up on),
    ``log`` (a file each open of a path is appended to, so several processes can be counted)."""

    protocol = ("edgefaulty",)
    instances: list = []

    def __init__(self, *a, flip: dict | None = None, http503: dict | None = None, log: str | None = None, **kw):
        super().__init__(*a, **kw)
        self.flip = dict(flip or {})
        self.http503 = dict(http503 or {})
        self.log = log
        self.opens: collections.Counter = collections.Counter()
        EdgeFS.instances.append(self)

    def _request(self, path: str) -> None:
        super()._request(path)
        if self._take(self.http503, path) is not None:
            # what s3fs raises once its own retries of a 503 SlowDown are spent: a plain IOError
            raise OSError(errno.EIO, f"503 Service Unavailable (SlowDown) on {path}")

    def _open(self, path, mode="rb", **kw):
        self.opens[path] += 1
        if self.log:
            with open(self.log, "a") as f:
                f.write(f"{os.getpid()} {path}\n")
        f = super()._open(path, mode, **kw)
        if self._take(self.flip, path) is not None:
            f = _Flip(f, self.fs.size(path) // 2)
        return f


class _Flip(faultfs.FileWrapper):
    def __init__(self, f, at: int):
        self.f, self.at, self.pos = f, at, 0

    def read(self, n=-1):
        data = self.f.read(n)
        if self.pos <= self.at < self.pos + len(data):
            b = bytearray(data)
            b[self.at - self.pos] ^= 0x10
            data = bytes(b)
        self.pos += len(data)
        return data


fsspec.register_implementation("edgefaulty", EdgeFS, clobber=True)


def last_fs() -> EdgeFS:
    return EdgeFS.instances[-1]


def corrupt(path: str, how: str, rng: random.Random) -> int:
    """Truncate at a random offset or flip one random bit; returns the offset."""
    size = os.path.getsize(path)
    at = rng.randrange(1, size - 1)
    if how == "truncate":
        os.truncate(path, at)
    else:
        flip_byte(path, at, 1 << rng.randrange(8))
    return at


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_dataset(str(tmp_path_factory.mktemp("src") / "ds"), shards=6, samples=6, sample_bytes=3000)


@pytest.fixture
def bad_src(src, tmp_path):
    d = str(tmp_path / "bad")
    shutil.copytree(src, d)
    return d


# --------------------------------------------------------------------------- corrupt source
@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["truncate", "flip"])
def test_corrupt_local_source_is_refetched_n_times_then_a_permanent_error(bad_src, tmp_path, how):
    m = open_dataset(bad_src).manifest
    corrupt(os.path.join(bad_src, m.shards[2].path), how, random.Random(hash(how) & 0xFFFF))
    url = "edgefaulty://" + bad_src
    r = warm(url, str(tmp_path / "c"), all_shards=True, retry=FAST, strict=True, jobs=2)
    assert r.status == "remote_failed" and r.exit_code == 1 and r.shards_failed == 1
    assert m.shards[2].path in r.error
    assert ("corrupt" in r.error) if how == "flip" else ("ended after" in r.error)
    # bounded: N tries of the bad shard, no more, no fewer
    assert last_fs().opens[os.path.join(bad_src, m.shards[2].path)] == FAST.attempts
    vd = VersionDir(str(tmp_path / "c"), r.version)
    assert not os.path.exists(vd.path(m.shards[2].path)) and temps(vd.root) == []
    # never trusted on the next run either
    again = warm(url, str(tmp_path / "c"), all_shards=True, retry=FAST, strict=True)
    assert again.shards_failed == 1 and again.shards_copied == 0 and again.shards_skipped == len(m.shards) - 1
    assert not vd.trusted(2, m.shards[2])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["truncate", "flip", "grow"])
def test_corrupt_s3_source_is_detected_before_publish(src, tmp_path, s3_server, how):  # noqa: F811
    url = s3_server.upload(src, f"corrupt-{how}/ds")
    m = open_dataset(src).manifest
    local = str(tmp_path / "one.tar")
    shutil.copyfile(os.path.join(src, m.shards[1].path), local)
    if how == "grow":  # the manifest's bytes, then more: the copy's last read asks one byte past its size
        with open(local, "ab") as f:
            f.write(b"\0" * 512)
    else:
        corrupt(local, how, random.Random(3))
    s3_server.fs().put_file(local, f"corrupt-{how}/ds/{m.shards[1].path}")
    r = warm(
        url, str(tmp_path / "c"), all_shards=True, retry=FAST, strict=True, storage_options=s3_server.storage_options
    )
    assert r.exit_code == 1 and r.shards_failed == 1 and m.shards[1].path in r.error, r.error
    assert {"truncate": "ended after", "flip": "corrupt", "grow": "larger than the manifest"}[how] in r.error, r.error
    vd = VersionDir(str(tmp_path / "c"), r.version)
    assert not os.path.exists(vd.path(m.shards[1].path)) and temps(vd.root) == []
    # the loader's fetch-on-miss refuses it too, naming the shard
    c = open_cache(url, str(tmp_path / "c"), storage_options=s3_server.storage_options, retry=FAST)
    with pytest.raises(NotCached, match=m.shards[1].path):
        c.local_shard(1)
    assert hash_file(c.local_shard(0))[0] == m.shards[0].hash


@pytest.mark.timeout(120)
def test_an_s3_shard_of_exactly_whole_chunks_is_copied(src, tmp_path, s3_server, monkeypatch):  # noqa: F811
    """A copy opens its object one byte longer than the manifest's size (no HEAD asks it); the
    last read of an object of whole chunks then asks a range wholly past its end (a 416), which
    ends the copy instead of failing it."""
    from shardtool.cache import store

    m = open_dataset(src).manifest
    monkeypatch.setattr(store, "CHUNK", m.shards[0].bytes)
    url = s3_server.upload(src, "whole-chunks/ds")
    r = warm(
        url, str(tmp_path / "c"), all_shards=True, retry=FAST, strict=True, storage_options=s3_server.storage_options
    )
    assert r.status == "ok" and r.retries == 0 and r.shards_copied == len(m.shards), r.summary()
    vd = VersionDir(str(tmp_path / "c"), r.version)
    assert all(hash_file(vd.path(s.path))[0] == s.hash for s in m.shards)


@pytest.mark.timeout(60)
def test_a_bit_flipped_in_transit_is_caught_by_the_hash_and_refetched(src, tmp_path):
    m = open_dataset(src).manifest
    r = warm(
        "edgefaulty://" + src,
        str(tmp_path),
        all_shards=True,
        retry=FAST,
        storage_options={"flip": {m.shards[3].path: 2}},
    )
    assert r.status == "ok", r.error
    assert r.retries == 2
    assert hash_file(open_dataset(r.version_dir).shard_path(3))[0] == m.shards[3].hash


# --------------------------------------------------------------------------- 404
@pytest.mark.timeout(60)
@pytest.mark.parametrize("what", ["shard", "index"])
def test_missing_object_is_one_request_and_a_named_permanent_error(src, tmp_path, what):
    m = open_dataset(src).manifest
    rel = m.shards[4].path if what == "shard" else m.shards[4].index
    r = warm(
        "edgefaulty://" + src,
        str(tmp_path),
        all_shards=True,
        strict=True,
        jobs=3,
        retry=RetryPolicy(attempts=8, base_delay=0.5),
        storage_options={"missing": [rel]},
    )
    assert r.status == "remote_failed" and r.exit_code == 1 and r.shards_failed == 1
    assert rel in r.error and "404" in r.error
    assert r.retries == 0 and r.seconds < 5  # no backoff sleeps
    assert last_fs().requests[os.path.join(src, rel)] == 1
    # fetch-on-miss: one request again, NotCached naming the shard
    c = open_cache(
        "edgefaulty://" + src,
        str(tmp_path / "c2"),
        storage_options={"missing": [rel]},
        retry=RetryPolicy(attempts=8, base_delay=0.5),
    )
    with pytest.raises(ShardtoolError, match=rel.replace(".", r"\.")):
        c.dataset.read(4, 0)
    assert last_fs().requests[os.path.join(src, rel)] == 1


# --------------------------------------------------------------------------- transient faults
@pytest.mark.timeout(60)
def test_resets_503s_and_short_reads_k_times_then_success(src, tmp_path):
    m = open_dataset(src).manifest
    opts = {"transient": {m.shards[0].path: 2}, "http503": {m.shards[1].path: 3}, "short": {m.shards[2].path: 2}}
    r = warm("edgefaulty://" + src, str(tmp_path), all_shards=True, retry=FAST, storage_options=opts)
    assert r.status == "ok", r.error
    assert r.retries == 2 + 3 + 2
    local = open_dataset(r.version_dir)
    for i, s in enumerate(m.shards):
        assert hash_file(local.shard_path(i))[0] == s.hash  # bytes verified at the end
    assert temps(r.version_dir) == []


@pytest.mark.timeout(120)
def test_s3_transient_faults_then_success(src, tmp_path, s3_server):  # noqa: F811
    url = s3_server.upload(src, "transient/ds")
    m = open_dataset(src).manifest
    opts = {
        "target_protocol": "s3",
        "target_options": s3_server.storage_options,
        "http503": {m.shards[0].path: 2},
        "short": {m.shards[1].path: 1},
        "transient": {m.shards[2].path: 1},
        "flip": {m.shards[3].path: 1},
    }
    r = warm("edgefaulty://" + url[len("s3://") :], str(tmp_path), all_shards=True, retry=FAST, storage_options=opts)
    assert r.status == "ok", r.error
    assert r.retries == 5
    local = open_dataset(r.version_dir)
    for i, s in enumerate(m.shards):
        assert hash_file(local.shard_path(i))[0] == s.hash


@pytest.mark.timeout(60)
def test_backoff_grows_with_full_jitter(src, tmp_path):
    from shardtool.cache.meta import ensure_shard
    from shardtool.cache.store import Origin

    ds = open_dataset(src)
    policy = RetryPolicy(attempts=6, base_delay=0.02, max_delay=0.08, attempt_timeout=10, stall_timeout=5)
    delays = []
    for run in range(4):
        fs = fsspec.filesystem("edgefaulty", transient={ds.manifest.shards[0].path: 5})
        vd = VersionDir(str(tmp_path / f"c{run}"), ds.version)
        ensure_shard(
            vd,
            0,
            ds.manifest.shards[0],
            Origin("edgefaulty://" + src, fs=fs, root=src),
            policy=policy,
            on_retry=lambda n, e, d: delays.append((n, d)),
        )
    for n, d in delays:
        assert 0 <= d <= min(policy.max_delay, policy.base_delay * 2 ** (n - 1))
    assert len({round(d, 6) for _, d in delays}) > len(delays) // 2  # jittered, not lock-step
    assert len(delays) == 4 * 5


@pytest.mark.timeout(60)
def test_a_stalled_read_times_out_per_attempt_and_is_retried(src, tmp_path):
    m = open_dataset(src).manifest
    began = time.monotonic()
    r = warm(
        "edgefaulty://" + src,
        str(tmp_path),
        all_shards=True,
        retry=FAST,
        storage_options={"stall": {m.shards[5].path: [30.0, 1]}},
    )
    took = time.monotonic() - began
    assert r.status == "ok", r.error
    assert r.retries == 1 and took < 10  # the 30 s stall was abandoned after stall_timeout (0.5 s)


@pytest.mark.timeout(60)
def test_a_source_stalled_for_good_ends_at_the_overall_deadline(src, tmp_path):
    m = open_dataset(src).manifest
    policy = RetryPolicy(attempts=1000, base_delay=0.05, max_delay=0.2, attempt_timeout=60, stall_timeout=1.0)
    began = time.monotonic()
    r = warm(
        "edgefaulty://" + src,
        str(tmp_path),
        all_shards=True,
        retry=policy,
        timeout=4,
        strict=True,
        storage_options={"stall": {m.shards[0].path: [120.0, 10_000]}},
    )
    took = time.monotonic() - began
    assert took < 4 + 3, f"warm ran {took:.1f}s past a 4 s deadline"
    assert r.exit_code == 1 and r.shards_failed == 1 and m.shards[0].path in r.error
    assert "deadline" in r.error or "within" in r.error
    assert r.shards_copied == len(m.shards) - 1
    assert not os.path.exists(VersionDir(str(tmp_path), r.version).path(m.shards[0].path))


# --------------------------------------------------------------------------- remote reads, no cache
def _read_all(ds, shard):
    return [ds.read(shard, i, decode=False) for i in range(ds.manifest.shards[shard].samples)]


@pytest.mark.timeout(60)
def test_remote_read_of_a_truncated_shard_names_it_faulty(bad_src):
    m = open_dataset(bad_src).manifest
    p = os.path.join(bad_src, m.shards[1].path)
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) // 3)  # later samples lie wholly past the end
    ds = open_dataset("faulty://" + bad_src)
    with pytest.raises(ShardtoolError, match=m.shards[1].path):
        _read_all(ds, 1)


@pytest.mark.timeout(120)
def test_remote_read_of_a_truncated_s3_shard_names_it(src, tmp_path, s3_server):  # noqa: F811
    url = s3_server.upload(src, "trunc-read/ds")
    m = open_dataset(src).manifest
    data = open(os.path.join(src, m.shards[1].path), "rb").read()
    s3_server.fs().pipe(f"trunc-read/ds/{m.shards[1].path}", data[: len(data) // 3])
    ds = open_dataset(url, storage_options=s3_server.storage_options)
    n = m.shards[1].samples
    for i in range(n):  # each sample: either whole and right, or an error naming the shard
        try:
            got = ds.read(1, i, decode=False)
        except ShardtoolError as e:
            assert m.shards[1].path in str(e) and "truncated" in str(e)
        else:
            assert got == open_dataset(src).read(1, i, decode=False)
    with pytest.raises(ShardtoolError, match=m.shards[1].path):
        ds.read(1, n - 1)


@pytest.mark.timeout(60)
def test_remote_read_of_a_flipped_shard_without_cache_is_detected(bad_src):
    # No whole-shard hash is possible on a ranged read: the index's per-sample checksum catches it.
    m = open_dataset(bad_src).manifest
    idx = open_dataset(bad_src).shard_index(0)
    p = os.path.join(bad_src, m.shards[0].path)
    at = int(idx.offsets[0]) + int(idx.field_offsets[0, 0]) + 5  # inside sample 0's payload
    flip_byte(p, at, 1)
    with pytest.raises(ShardtoolError, match=m.shards[0].path + r" sample #0 .*checksum"):
        open_dataset("faulty://" + bad_src).read(0, 0, decode=False)
