"""Compressed Arrow shards enter the node cache plain (cache/plain.py): verified as stored,
decompressed once under the shard's lock, trusted by the plain file's own recorded hash."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardtool
from helpers.data_gen import pack_compressed_pairs
from helpers.fsutil import flip_byte, temps
from helpers.realtext import byte_ids, stdlib_files
from helpers.runcli import repo_env, shardtool_cli
from shardtool.cache import RetryPolicy, VersionDir, admin, open_cache, warm
from shardtool.cache.errors import NotCached
from shardtool.cache.plain import record_path, stored_copy_path
from shardtool.loader import ShardedLoader

pytestmark = pytest.mark.timeout(240)
FAST = RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.05, attempt_timeout=20, stall_timeout=5)


def _rows(n: int = 3000, seed: int = 5) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {
            "tokens": rng.integers(0, 300, int(rng.integers(1, 160))).astype(np.int32),
            "n": i,
            "text": f"doc {i} " * (i % 7),
            "meta": {"i": i},
        }
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    d = tmp_path_factory.mktemp("plain")
    rows = _rows()
    return pack_compressed_pairs(rows, d, (None, "zstd"), 150_000)


def _copy(url: str, to) -> str:
    dst = str(to)
    shutil.copytree(url, dst)
    return dst


def _batches(url, workers=0, **kw):
    ld = ShardedLoader(url, max_tokens=2048, seed=3, rank=0, world_size=1, num_workers=workers, **kw)
    return [{k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in b.items()} for b in ld]


def _plain_sizes(report) -> list[int]:
    ds = shardtool.open_dataset(report.version_dir)
    return [os.path.getsize(os.path.join(report.version_dir, s.path)) for s in ds.manifest.shards]


def _is_plain_arrow(path: str) -> bool:
    """Every buffer of a batch read from the mapped file lies inside the map (nothing was decompressed)."""
    import pyarrow as pa

    buf = pa.memory_map(path).read_buffer()
    rb = pa.ipc.open_file(buf).get_batch(0)
    data = rb.column(1).values.buffers()[1]  # the tokens' values
    return buf.address <= data.address < buf.address + buf.size


@pytest.mark.parametrize("workers", [0, 2])
def test_warmed_compressed_dataset_reads_like_plain_with_the_source_gone(packed, tmp_path, workers):
    src = _copy(packed["zstd"], tmp_path / "src")
    cdir = str(tmp_path / "cache")
    r = warm(src, cdir, all_shards=True, jobs=3, progress=False)
    assert r.status == "ok" and r.shards_copied == r.assigned > 3, r.summary()
    m = shardtool.open_dataset(src).manifest
    assert r.compression == "zstd" and r.decompressed
    assert r.bytes_copied == m.num_bytes  # stored bytes moved from the source
    assert r.cache_bytes_written == sum(_plain_sizes(r)) > 1.3 * m.num_bytes  # plain bytes in the cache
    assert "decompressed" in r.summary()
    for s in m.shards:
        assert abs(os.path.getsize(os.path.join(r.version_dir, s.path)) - s.raw_bytes) < 4096
    assert _is_plain_arrow(os.path.join(r.version_dir, m.shards[0].path))
    assert temps(cdir) == [] and not os.listdir(os.path.dirname(stored_copy_path(VersionDir(cdir, r.version), 0)))
    shutil.rmtree(src)
    want = _batches(packed[None], workers)
    assert _batches(src, workers, cache_dir=cdir) == want
    dc = open_cache(src, cdir)
    assert all(dc.is_cached(i) and dc.is_plain(i) for i in range(dc.dataset.num_shards))
    assert not dc.dataset.shard_compressed(0)
    assert [dc.dataset.read(s, 3)["n"] for s in range(dc.dataset.num_shards)] == [
        shardtool.open_dataset(packed[None]).read(s, 3)["n"] for s in range(dc.dataset.num_shards)
    ]
    assert admin.verify(cdir) == {"ok": dc.dataset.num_shards, "bad": [], "busy": [], "metadata_bad": []}


def test_flipped_byte_in_the_compressed_source_is_refused_at_warm_and_at_fetch(packed, tmp_path):
    src = _copy(packed["zstd"], tmp_path / "src")
    ds = shardtool.open_dataset(src)
    flip_byte(ds.shard_path(1), ds.manifest.shards[1].bytes // 2)
    cdir = str(tmp_path / "cache")
    r = warm(src, cdir, all_shards=True, retry=FAST, progress=False)
    assert r.shards_failed == 1 and r.failures[0]["shard"] == 1 and r.failures[0]["kind"] == "SourceCorrupt"
    assert ds.manifest.shards[1].path in r.failures[0]["error"]
    vd = VersionDir(cdir, r.version)
    assert not os.path.exists(vd.path(ds.manifest.shards[1].path)) and not os.path.exists(stored_copy_path(vd, 1))
    assert not os.path.exists(record_path(vd, 1)) and temps(cdir) == []
    # A loader's fetch-on-miss refuses it the same way, and publishes nothing.
    dc = open_cache(src, str(tmp_path / "cache2"), retry=FAST)
    with pytest.raises(NotCached, match=r"shard #1 .*(corrupt|hash)"):
        dc.local_shard(1)
    assert not os.path.exists(dc.vdir.path(ds.manifest.shards[1].path))
    assert dc.local_shard(0) and dc.is_plain(0)


def test_flipped_byte_in_the_plain_cached_file_is_caught_by_the_stamp_and_by_verify(packed, tmp_path):
    src = _copy(packed["zstd"], tmp_path / "src")
    cdir = str(tmp_path / "cache")
    r = warm(src, cdir, all_shards=True, progress=False)
    vd = VersionDir(cdir, r.version)
    m = shardtool.open_dataset(src).manifest
    with open(record_path(vd, 0)) as f:
        rec = json.load(f)
    assert rec["stored_hash"] == m.shards[0].hash and rec["bytes"] == os.path.getsize(vd.path(m.shards[0].path))
    # A write voids the stamp: the shard is re-hashed against its plain record, found bad, refetched.
    p0 = vd.path(m.shards[0].path)
    flip_byte(p0, os.path.getsize(p0) // 2)
    assert not vd.trusted(0, m.shards[0])
    dc = open_cache(src, cdir)
    assert not dc.is_cached(0)
    assert _batches(src, 0, cache_dir=cdir) == _batches(packed[None], 0)
    assert vd.trusted(0, m.shards[0]) and dc.fetched_bytes == 0  # the loader's own object refetched it
    # A flip that keeps size and mtime (the stamp cannot see it) is caught by `cache verify`.
    p1 = vd.path(m.shards[1].path)
    st = os.stat(p1)
    flip_byte(p1, st.st_size // 3)
    os.utime(p1, ns=(st.st_atime_ns, st.st_mtime_ns))
    res = admin.verify(cdir)
    assert res["bad"] == [p1] and res["ok"] == len(m.shards) - 1 and not os.path.exists(p1)
    # Without its source the shard is not served from a bad copy.
    shutil.rmtree(src)
    with pytest.raises(NotCached):
        open_cache(src, cdir).local_shard(1)


def test_keep_compressed_caches_and_caches_warmed_before_read_alike(packed, tmp_path):
    src = packed["zstd"]
    cdir = str(tmp_path / "cache")
    r = warm(src, cdir, all_shards=True, keep_compressed=True, progress=False)
    m = shardtool.open_dataset(src).manifest
    assert r.status == "ok" and not r.decompressed and "kept compressed" in r.summary()
    assert _plain_sizes(r) == [s.bytes for s in m.shards]
    vd = VersionDir(cdir, r.version)
    # A stamp without a plain record is what every cache warmed before decompression holds.
    for i in range(len(m.shards)):
        with open(vd.stamp_path(i)) as f:
            assert "stored_hash" not in json.load(f)
    want = _batches(packed[None], 0)
    assert _batches(src, 0, cache_dir=cdir) == want
    assert _batches(src, 2, cache_dir=cdir) == want
    # Fetch-on-miss follows the node's choice: the missing shard comes back compressed.
    os.unlink(vd.path(m.shards[2].path))
    dc = open_cache(src, cdir)
    dc.local_shard(2)
    assert not dc.is_plain(2) and os.path.getsize(vd.path(m.shards[2].path)) == m.shards[2].bytes
    # A default warm over it keeps what is trusted (no rewrite) and still reads the same.
    again = warm(src, cdir, all_shards=True, progress=False)
    assert again.shards_copied == 0 and again.decompressed
    assert _batches(src, 0, cache_dir=cdir) == want


def test_the_budget_counts_plain_bytes(packed, tmp_path):
    src = packed["zstd"]
    m = shardtool.open_dataset(src).manifest
    stored, plain = m.num_bytes, sum(s.raw_bytes for s in m.shards)
    assert plain > 1.3 * stored
    between = (stored + plain) // 2
    r = warm(src, str(tmp_path / "a"), all_shards=True, max_bytes=between, progress=False)
    assert r.status == "local_fault" and "short by" in r.error and "--best-effort" in r.error  # says what to do
    assert (
        warm(src, str(tmp_path / "b"), all_shards=True, max_bytes=between, keep_compressed=True, progress=False).status
        == "ok"
    )
    be = warm(src, str(tmp_path / "c"), all_shards=True, max_bytes=between, best_effort=True, progress=False)
    assert be.status == "partial" and be.not_fitted
    assert sum(_plain_sizes_present(be)) <= between
    # Fetch-on-miss makes room by plain bytes too: a budget of one plain shard holds one.
    one = max(s.raw_bytes for s in m.shards) + 8192
    dc = open_cache(src, str(tmp_path / "d"), max_bytes=one)
    for i in range(3):
        with dc.reading(i):
            pass
    assert sum(_plain_sizes_present_dir(dc.vdir, m)) <= one


def _plain_sizes_present(report):
    return _plain_sizes_present_dir(
        VersionDir(report.cache_dir, report.version), shardtool.open_dataset(report.version_dir).manifest
    )


def _plain_sizes_present_dir(vd, m):
    return [os.path.getsize(vd.path(s.path)) for s in m.shards if os.path.exists(vd.path(s.path))]


RACER = r"""
import json, os, sys, time
from shardtool.cache import open_cache, warm
kind, src, cdir, go = sys.argv[1:5]
while not os.path.exists(go):
    time.sleep(0.001)
if kind == "warm":
    r = warm(src, cdir, all_shards=True, jobs=2, progress=False)
    print(json.dumps({"status": r.status, "copied": r.bytes_copied}))
else:
    dc = open_cache(src, cdir)
    for i in reversed(range(dc.dataset.num_shards)):
        with dc.reading(i):
            pass
    print(json.dumps({"status": "ok", "copied": dc.fetched_bytes}))
"""


@pytest.mark.timeout(180)
def test_concurrent_decompression_by_warmers_and_a_loader_yields_one_good_file(tmp_path):
    rng = np.random.default_rng(1)
    rows = [{"tokens": rng.integers(0, 300, int(rng.integers(200, 900))).astype(np.int32)} for _ in range(6000)]
    src = str(tmp_path / "src")
    shardtool.pack(rows, src, format="arrow", length="tokens", shard_size=3_000_000, compression="zstd")
    m = shardtool.open_dataset(src).manifest
    assert len(m.shards) >= 3
    cdir, go = str(tmp_path / "cache"), str(tmp_path / "go")
    env = repo_env()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, kind, src, cdir, go],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for kind in ("warm", "warm", "load", "load")
    ]
    time.sleep(2.0)  # every process imported and waiting
    open(go, "w").close()
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=150)
        assert p.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert all(o["status"] == "ok" for o in outs), outs
    # Each shard was fetched and decompressed by exactly one of the four.
    assert sum(o["copied"] for o in outs) == m.num_bytes, outs
    dc = open_cache(src, cdir)
    assert all(dc.is_cached(i) and dc.is_plain(i) for i in range(len(m.shards)))
    assert admin.verify(cdir)["ok"] == len(m.shards) and temps(cdir) == []
    want = [s["tokens"].tolist() for s in shardtool.open_dataset(src)]
    got = [s["tokens"].tolist() for s in dc.dataset]
    assert got == want


def test_real_text_compressed_through_the_cache(tmp_path):
    files = stdlib_files(400)
    rows = [{"tokens": byte_ids(p), "path": os.path.relpath(p)} for p in files]
    for comp in (None, "zstd"):
        shardtool.pack(
            rows,
            str(tmp_path / (comp or "plain")),
            format="arrow",
            length="tokens",
            shard_size=1_000_000,
            compression=comp,
        )
    src = str(tmp_path / "zstd")
    cdir = str(tmp_path / "cache")
    r = warm(src, cdir, all_shards=True, jobs=2, progress=False)
    assert r.status == "ok" and r.cache_bytes_written > 1.5 * r.bytes_copied  # source text compresses well
    kw = dict(batch_size=4, seq_len=4096, seed=0, rank=0, world_size=1)

    def epoch(url, workers=0, **more):
        return [
            {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in b.items()}
            for b in ShardedLoader(url, num_workers=workers, **kw, **more)
        ]

    want = epoch(str(tmp_path / "plain"))
    assert want and epoch(src, 2) == want  # read in place, compressed
    shutil.rmtree(src)
    assert epoch(src, cache_dir=cdir) == want


def test_inspect_and_plan_report_stored_and_plain_bytes(packed):
    from shardtool.pack.inspection import inspect

    m = shardtool.open_dataset(packed["zstd"]).manifest
    plain = sum(s.raw_bytes for s in m.shards)
    info = inspect(packed["zstd"], peek=False)
    assert info["stored_bytes"] == m.num_bytes and info["plain_bytes"] == plain
    assert inspect(packed[None], peek=False)["plain_bytes"] == shardtool.open_dataset(packed[None]).manifest.num_bytes
    r = shardtool_cli("plan", packed["zstd"], "--nodes", "2", "--ranks-per-node", "2", "--batch-size", "8", "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["compression"] == "zstd" and sum(rep["per_node"]["plain_bytes"]) >= plain  # boundary shards twice
    assert rep["plain_bytes_per_node"]["max"] > 1.3 * rep["bytes_per_node"]["max"]
    text = shardtool_cli("plan", packed["zstd"], "--nodes", "2", "--ranks-per-node", "2", "--batch-size", "8").stdout
    assert "plain/node" in text


def _epoch(url, workers=0, seed=4, **kw):
    ld = ShardedLoader(url, seed=seed, rank=0, world_size=1, num_workers=workers, **kw)
    return [{k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in b.items()} for b in ld]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize(
    "shape", [dict(max_tokens=2048), dict(batch_size=8, seq_len=256), dict(batch_size=16, pad_id=2**40)]
)
def test_compressed_read_in_place_gathers_batches_like_plain(packed, workers, shape):
    assert _epoch(packed["zstd"], workers, **shape) == _epoch(packed[None], workers, **shape)


def test_a_pass_in_place_decompresses_each_record_batch_once(packed, monkeypatch):
    from shardtool.loader.shardview import CompressedBatches

    monkeypatch.setenv("SHARDTOOL_DECOMPRESSED_SHARE", "0")  # no shard held whole: batch by batch

    ds = shardtool.open_dataset(packed["zstd"])
    batches = sum(len(np.unique(ds.shard_index(s).batch)) for s in range(ds.num_shards))
    ld = ShardedLoader(packed["zstd"], max_tokens=1024, seed=2, rank=0, world_size=1, num_workers=0)
    before = CompressedBatches.decompressed
    assert len(list(ld)) > 50  # shuffled batches: each touches many record batches, each record batch many batches
    assert CompressedBatches.decompressed - before == batches


def test_compressed_ranged_reads_without_a_cache_fetch_each_record_batch_once_per_batch(packed):
    import fsspec

    fs = fsspec.filesystem("memory")  # not local: the loader reads it by ranged requests, sample by sample
    fs.put(packed["zstd"], "/zs-remote", recursive=True)
    want = _epoch(packed[None], 0, batch_size=32)
    ld = ShardedLoader("memory:///zs-remote", seed=4, rank=0, world_size=1, num_workers=0, batch_size=32)
    got = [{k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in b.items()} for b in ld]
    assert got == want
    # The remote tier counts a record batch's bytes once per run of its rows: read in (shard,
    # sample) order, once per training batch that touches it, not once per sample.
    remote = ld.metrics()["cumulative"]["bytes_read"]["remote"]
    ds = shardtool.open_dataset(packed["zstd"])
    per_sample = sum(int(ds.shard_index(s).sizes.sum()) for s in range(ds.num_shards))
    assert 0 < remote < 0.8 * per_sample


def test_warm_cli_keep_compressed_and_the_json_report(packed, tmp_path):
    m = shardtool.open_dataset(packed["zstd"]).manifest
    for flag, plain in (([], True), (["--keep-compressed"], False)):
        cdir = str(tmp_path / ("keep" if flag else "plain"))
        r = shardtool_cli("warm", packed["zstd"], "--cache-dir", cdir, "--all", "--json", "-q", *flag, timeout=120)
        assert r.returncode == 0, r.stderr
        rep = json.loads(r.stdout)
        assert rep["compression"] == "zstd" and rep["decompressed"] is plain
        assert rep["bytes_copied"] == m.num_bytes
        assert rep["cache_bytes_written"] == (
            sum(_plain_sizes_present_dir(VersionDir(cdir, rep["version"]), m)) if plain else m.num_bytes
        )
        assert rep["assigned_cache_bytes"] == (sum(s.raw_bytes for s in m.shards) if plain else m.num_bytes)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**16),
    size=st.sampled_from([("batch_size", 1), ("batch_size", 7), ("max_tokens", 700)]),
    cache_bytes=st.sampled_from([1 << 16, 1 << 20, 256 << 20]),
)
def test_compressed_in_place_batches_equal_plain_whatever_the_seed_and_the_batch_cache(
    packed, monkeypatch, seed, size, cache_bytes
):
    """The delivered batches never depend on how many decompressed batches a process keeps."""
    from shardtool.loader import batchcache

    monkeypatch.setenv("SHARDTOOL_DECOMPRESSED_SHARE", "0")

    old = batchcache.CompressedBatches._cap
    batchcache.CompressedBatches._cap = cache_bytes  # the budget is at least CACHE_BYTES: set it too
    old_min = batchcache.CompressedBatches.CACHE_BYTES
    batchcache.CompressedBatches.CACHE_BYTES = cache_bytes
    try:
        kw = {size[0]: size[1], "seed": seed}
        assert _epoch(packed["zstd"], 0, **kw) == _epoch(packed[None], 0, **kw)
    finally:
        batchcache.CompressedBatches._cap = old
        batchcache.CompressedBatches.CACHE_BYTES = old_min


def test_a_share_larger_than_the_decompressed_batches_kept_is_warned_about(packed, monkeypatch):
    """Shuffled reads of a share the batch cache cannot hold decompress most batches again and
    again: the loader says so once, and names the way out (a node cache)."""
    from shardtool.loader import batchcache

    monkeypatch.setenv("SHARDTOOL_DECOMPRESSED_SHARE", "0")

    cls = batchcache.CompressedBatches
    saved = cls._cap, cls.CACHE_BYTES, cls._warned
    cls._cap = cls.CACHE_BYTES = 1 << 16
    cls._warned = False
    try:
        with pytest.warns(RuntimeWarning, match="exceeds the decompressed record batches.*cache_dir"):
            assert _epoch(packed["zstd"], 0, batch_size=64) == _epoch(packed[None], 0, batch_size=64)
    finally:
        cls._cap, cls.CACHE_BYTES, cls._warned = saved


def test_gc_removes_a_killed_warms_stored_copies_but_not_a_busy_ones(packed, tmp_path):
    """A warm killed while decompressing leaves the stored bytes (up to a compressed shard) and
    their temp under .shardtool/stored/; `gc` said "removed 0 temp files" and left them."""
    from shardtool.cache.locks import try_exclusive

    src = _copy(packed["zstd"], tmp_path / "src")
    cdir = str(tmp_path / "cache")
    r = warm(src, cdir, all_shards=True, progress=False)
    vd = VersionDir(cdir, r.version)
    folder = os.path.dirname(stored_copy_path(vd, 0))
    for shard in (1, 2):  # what a SIGKILL mid-decompression leaves: the stored copy and its temp
        with open(stored_copy_path(vd, shard), "wb") as f:
            f.write(b"x" * 1000)
        with open(os.path.join(folder, f".tmp-{shard}.part"), "wb") as f:
            f.write(b"x" * 10)
    with try_exclusive(vd.lock_path(2)) as held:  # shard 2's holder is alive: its files stay
        assert held
        assert admin.gc(cdir)["temps_removed"] == 2
        assert sorted(os.listdir(folder)) == [".tmp-2.part", "2"]
    assert admin.gc(cdir)["temps_removed"] == 2 and os.listdir(folder) == []
    assert admin.verify(cdir)["ok"] == len(shardtool.open_dataset(src).manifest.shards)
