"""How many requests one node makes of the object store (issue 38: thousands of nodes, one store).

Real text (stdlib files, tests/helpers/s3proxy.py ``stdlib_dataset``) packed as 13 Arrow shards, uploaded
to moto, read by s3fs through the counting proxy of tests/helpers/s3proxy.py. What is guaranteed is
asserted: the warmer and the loader's fetch-on-miss get each object whole exactly once (one GET,
every byte of it), list nothing and, with no faults, retry nothing; start-up reads no shard. The
rest (HEADs, the loader's ranged reads without a cache) is printed, not pinned.
"""

from __future__ import annotations

import os
import socket
import threading

import pytest
import torch

from helpers.s3proxy import Faults, S3Proxy, TokenBucket, classify, s3_proxy, stdlib_dataset  # noqa: F401  (fixture)
from helpers.s3server import s3_server  # noqa: F401  (fixture)
from shardtool.cache import warm
from shardtool.format import open_dataset
from shardtool.format.manifest import LENGTHS_NAME, MANIFEST_NAME
from shardtool.format.summaries import SUMMARIES_NAME
from shardtool.loader import ShardedLoader

pytestmark = pytest.mark.timeout(240)  # the moto server is a subprocess
PREFIX = "counts/ds"
# The ranged read of one shard's tail (its footer: the schema record batches are decoded with),
# once for the whole dataset: a footer opened through pyarrow cost a HEAD and two reads.
OPEN_ARROW = 1
LOADER = dict(batch_size=8, num_workers=0, seed=0, rank=0, world_size=1)


@pytest.fixture(scope="module")
def served(tmp_path_factory, s3_server):  # noqa: F811
    """(local root, s3:// URL) of the real-text dataset, uploaded to moto once."""
    src = stdlib_dataset(str(tmp_path_factory.mktemp("s3counts") / "ds"))
    return src, s3_server.upload(src, PREFIX)


def key(rel: str) -> str:
    return f"{PREFIX}/{rel}"


def batches(url, **kw) -> list[dict]:
    ld = ShardedLoader(url, **LOADER, **kw)
    return [{k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in b.items()} for b in ld]


def gets(c) -> dict[str, int]:
    """{key: whole-or-ranged GETs of it}."""
    out: dict[str, int] = {}
    for (k, kind), n in c.by_key_kind.items():
        if kind in ("GET", "RANGED_GET"):
            out[k] = out.get(k, 0) + n
    return out


def show(label: str, c) -> None:
    print(f"\n{label}: {c.summary()}")


def assert_fetched_whole_once(c, src: str, rels: list[str]) -> None:
    """Each object of ``rels`` got exactly one GET, which served all its bytes."""
    g = gets(c)
    for rel in rels:
        size = os.path.getsize(os.path.join(src, rel))
        assert g.get(key(rel)) == 1, (rel, g.get(key(rel)))
        assert c.bytes_by_key[key(rel)] == size, (rel, c.bytes_by_key[key(rel)], size)


def no_faults_seen(c) -> None:
    assert c.throttled == c.resets == 0
    assert all(code < 400 for code in c.status), c.status  # no error, so nothing to retry
    assert c.by_kind["LIST"] == 0  # no listing: every name comes from the manifest


# --------------------------------------------------------------------------- the proxy itself
def test_the_proxy_forwards_requests_unchanged_and_counts_them_by_kind(s3_server):  # noqa: F811
    data = os.urandom(300_000)
    with S3Proxy(s3_server.endpoint) as proxy:
        fs = proxy_fs(proxy)
        fs.call_s3("create_bucket", Bucket="proxyself")
        fs.pipe("proxyself/a/blob", data)  # a PUT through the proxy: signed for it, accepted by moto
        assert s3_server.fs().cat_file("proxyself/a/blob") == data  # what moto holds, read directly
        assert fs.cat_file("proxyself/a/blob") == data
        assert fs.cat_file("proxyself/a/blob", start=1000, end=1010) == data[1000:1010]
        assert fs.ls("proxyself/a", detail=False) == ["proxyself/a/blob"]
        c = proxy.counts()
        show("proxy self-test", c)
        assert c.by_key_kind[("proxyself/a/blob", "PUT")] == 1
        assert c.by_key_kind[("proxyself/a/blob", "RANGED_GET")] == 1
        assert c.by_key_kind[("proxyself", "LIST")] == 1
        assert c.bytes_by_key["proxyself/a/blob"] >= len(data) + 10
        assert c.total == sum(c.by_kind.values()) == sum(c.by_method.values()) == c.forwarded
        assert proxy.reset().total == c.total and proxy.counts().total == 0
        assert proxy.threads_alive() >= 1  # s3fs keeps its connection alive
    assert proxy.threads_alive() == 0  # stop() joined every connection's thread
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", proxy.port), timeout=2).close()


def proxy_fs(proxy):
    import s3fs

    return s3fs.S3FileSystem(**proxy.storage_options)


def test_request_kinds():
    h = {"Range": "bytes=0-9"}
    assert classify("GET", "/b/k/x.arrow", h).kind == "RANGED_GET"
    assert classify("GET", "/b/k/x.arrow", {}).kind == "GET"
    assert classify("GET", "/b?list-type=2&prefix=k%2F", {}).kind == "LIST"
    assert classify("GET", "/b", {}).kind == "LIST"
    assert classify("GET", "/b?location", {}).kind == "OTHER"
    assert classify("HEAD", "/b/k%20x", {}).key == "b/k x"


def test_token_bucket_lets_rate_through_after_its_burst():
    now = [0.0]
    tb = TokenBucket(rate=10, burst=3, clock=lambda: now[0])
    assert [tb.take() for _ in range(4)] == [True, True, True, False]
    now[0] += 0.1  # one token
    assert [tb.take(), tb.take()] == [True, False]
    now[0] += 10  # refills to the burst, no more
    assert sum(tb.take() for _ in range(10)) == 3


def test_counts_are_exact_under_concurrent_clients(s3_server, served):  # noqa: F811
    src, url = served
    rel = open_dataset(src).manifest.shards[0].index
    with S3Proxy(s3_server.endpoint, Faults(latency=0.01)) as proxy:
        fs = proxy_fs(proxy)
        want = open(os.path.join(src, rel), "rb").read()
        errors = []

        def client():
            try:
                for _ in range(10):
                    assert fs.cat_file(key(rel), start=0, end=len(want)) == want
            except BaseException as e:  # reported by the main thread
                errors.append(e)

        threads = [threading.Thread(target=client) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors and not any(t.is_alive() for t in threads)
        c = proxy.counts()
    assert c.by_key_kind[(key(rel), "RANGED_GET")] == 60 and c.bytes_by_key[key(rel)] == 60 * len(want)


# --------------------------------------------------------------------------- warm of one node
def test_warm_of_one_node_gets_each_object_whole_once_and_lists_nothing(served, s3_proxy, tmp_path):  # noqa: F811
    src, url = served
    m = open_dataset(src).manifest
    r = warm(url, str(tmp_path / "c"), storage_options=s3_proxy.storage_options, progress=False)
    assert r.status == "ok" and r.shards_copied == len(m.shards) and r.retries == 0, r.summary()
    c = s3_proxy.reset()
    show(f"warm of one node ({len(m.shards)} shards, {sum(s.bytes for s in m.shards)} bytes)", c)
    objects = [MANIFEST_NAME, SUMMARIES_NAME, LENGTHS_NAME] + [s.path for s in m.shards] + [s.index for s in m.shards]
    assert_fetched_whole_once(c, src, objects)
    assert set(gets(c)) == {key(o) for o in objects}  # nothing else read
    no_faults_seen(c)
    # no object's size is asked: whole reads are "bytes=0-", a shard's reads name their ranges
    assert c.by_kind["HEAD"] == 0
    assert c.total == c.by_kind["GET"] + c.by_kind["RANGED_GET"]

    # the same node again: the cache is complete, so no shard and no index is read again
    again = warm(url, str(tmp_path / "c"), storage_options=s3_proxy.storage_options, progress=False)
    assert again.status == "ok" and again.shards_copied == 0 and again.shards_skipped == len(m.shards)
    c = s3_proxy.reset()
    show("warm of a warm node", c)
    assert set(gets(c)) == {key(MANIFEST_NAME)}, gets(c)
    no_faults_seen(c)


# --------------------------------------------------------------------------- loader, one rank
def test_loader_start_up_reads_no_shard_and_an_epoch_without_cache_reads_ranges(served, s3_proxy):  # noqa: F811
    src, url = served
    m = open_dataset(src).manifest
    want = batches(src)
    ld = ShardedLoader(url, storage_options=s3_proxy.storage_options, **LOADER)
    start = s3_proxy.reset()
    show("loader start-up, no cache", start)
    # Made, the loader has read the manifest and the summaries; the lengths of its range (the
    # .npy header and the range: two requests), the rank's sample indexes and the record batches'
    # schema (one shard's tail) are on their way in the background (loader/indexahead.py), so
    # some of them may be counted here already, none more often.
    early = {key(s.index): 1 for s in m.shards} | {key(m.shards[0].path): 1, key(LENGTHS_NAME): 2}
    got_early = gets(start)
    assert {k: got_early.pop(k) for k in (key(MANIFEST_NAME), key(SUMMARIES_NAME))} == {
        key(MANIFEST_NAME): 1,
        key(SUMMARIES_NAME): 1,
    }, gets(start)
    assert all(n <= early.get(k, 0) for k, n in got_early.items()), gets(start)
    no_faults_seen(start)
    got = [{k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in b.items()} for b in ld]
    c = s3_proxy.reset()
    show(f"loader epoch, no cache ({len(got)} batches of {LOADER['batch_size']})", c)
    assert got == want
    no_faults_seen(c)
    # Each index once (at start-up or in the epoch), as one ranged GET of bytes=0- (no HEAD asking
    # its size first); the shards by ranged reads only, each record batch about once: a sample
    # read fetches its Arrow record batch (checked against the index), which the reader keeps for
    # the pass (loader/batchcache.py). Read sample by sample, a shuffled epoch fetched a record
    # batch once per sample in it: here 10.6x the shards' bytes.
    g = gets(c)
    for s in m.shards:
        index_gets = (key(s.index), "RANGED_GET")
        assert g.get(key(s.index), 0) + gets(start).get(key(s.index), 0) == 1
        assert c.by_key_kind[index_gets] + start.by_key_kind[index_gets] == 1
        assert c.by_key_kind[(key(s.index), "HEAD")] == 0
        ranged = c.by_key_kind[(key(s.path), "RANGED_GET")]
        assert c.by_key_kind[(key(s.path), "GET")] == 0 and 1 <= ranged <= s.samples + OPEN_ARROW
        assert c.by_key_kind[(key(s.path), "HEAD")] == 0
        assert c.bytes_by_key[key(s.path)] <= (s.samples + OPEN_ARROW) * s.bytes
    read = sum(c.bytes_by_key[key(s.path)] for s in m.shards)
    total = sum(s.bytes for s in m.shards)
    assert read <= 1.05 * total, f"{read / total:.1f}x the shards' bytes read"
    print(
        f"ranged GETs per shard: {[c.by_key_kind[(key(s.path), 'RANGED_GET')] for s in m.shards]}, "
        f"samples per shard: {[s.samples for s in m.shards]}; "
        f"shard bytes read {read} of {total} ({read / total:.1f}x)"
    )


def test_loader_with_a_cache_fetches_each_shard_whole_once(served, s3_proxy, tmp_path):  # noqa: F811
    src, url = served
    m = open_dataset(src).manifest
    want = batches(src)
    cache = str(tmp_path / "cache")
    ld = ShardedLoader(url, storage_options=s3_proxy.storage_options, cache_dir=cache, **LOADER)
    c = s3_proxy.reset()
    show("loader start-up, empty cache", c)
    assert gets(c) == {key(MANIFEST_NAME): 1, key(SUMMARIES_NAME): 1}, gets(c)
    no_faults_seen(c)
    got = [{k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in b.items()} for b in ld]
    c = s3_proxy.reset()
    show(f"loader epoch, fetch on miss ({len(got)} batches)", c)
    assert got == want
    assert_fetched_whole_once(c, src, [s.path for s in m.shards] + [s.index for s in m.shards])
    no_faults_seen(c)
    # a second epoch, and a new loader on the same node: all cached, only the manifest is read
    assert batches(url, storage_options=s3_proxy.storage_options, cache_dir=cache) == want
    c = s3_proxy.reset()
    show("second loader on the filled cache (start-up and epoch)", c)
    assert set(gets(c)) == {key(MANIFEST_NAME)}, gets(c)


def test_workers_reuse_the_metadata_their_rank_read_and_fetch_indexes_once(served, s3_proxy):  # noqa: F811
    """A forked worker reopens the dataset from its rank's (its own session, the manifest,
    summaries and sample indexes carried over), and the pass's indexes are fetched once, at
    once, before the workers fork: 2 workers make no metadata request of their own."""
    src, url = served
    m = open_dataset(src).manifest
    want = batches(src)
    s3_proxy.reset()
    ld = ShardedLoader(url, storage_options=s3_proxy.storage_options, **{**LOADER, "num_workers": 2})
    got = [{k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in b.items()} for b in ld]
    c = s3_proxy.counts()
    show("loader start-up + epoch, no cache, 2 workers", c)
    assert got == want
    g = gets(c)
    assert g[key(MANIFEST_NAME)] == 1 and g[key(SUMMARIES_NAME)] == 1
    assert all(g[key(s.index)] == 1 for s in m.shards), {s.index: g[key(s.index)] for s in m.shards}
    read = sum(c.bytes_by_key[key(s.path)] for s in m.shards)
    assert read <= 2.1 * sum(s.bytes for s in m.shards)  # each worker fetches the record batches it reads


# --------------------------------------------------------------------------- coalesced ranges
def shard_gets(c, m, prefix: str = PREFIX) -> int:
    return sum(c.by_key_kind[(f"{prefix}/{s.path}", "RANGED_GET")] for s in m.shards)


def stdlib_remote(tmp_path_factory, s3_server, name: str, **pack):  # noqa: F811
    """120 stdlib files packed with ``pack`` options, uploaded to ``counts/<name>``: (local root, URL, manifest)."""
    import shardtool
    from helpers.realtext import byte_ids, stdlib_files

    src = str(tmp_path_factory.mktemp(f"s3{name}") / "ds")
    rows = [{"tokens": byte_ids(p), "path": os.path.relpath(p)} for p in stdlib_files(120)]
    shardtool.pack(rows, src, length="tokens", **pack)
    return src, s3_server.upload(src, f"counts/{name}"), open_dataset(src).manifest


def read_with_and_without_coalescing(s3_proxy, monkeypatch, src, url, m, prefix, **kw):  # noqa: F811
    """{gap setting: (ranged GETs of the shards, their bytes)} of an epoch read through the proxy
    with coalescing off ("-1") and at its default (None), each checked to serve the local batches."""
    kw = dict(num_workers=0, shuffle=False, rank=0, world_size=1, metrics=False, **kw)
    want = [b["__key__"] for b in ShardedLoader(src, **kw)]
    got = {}
    for gap in ("-1", None):
        if gap is None:
            monkeypatch.delenv("SHARDTOOL_COALESCE_GAP", raising=False)
        else:
            monkeypatch.setenv("SHARDTOOL_COALESCE_GAP", gap)
        ld = ShardedLoader(url, storage_options=s3_proxy.storage_options, **kw)
        s3_proxy.reset()
        assert [b["__key__"] for b in ld] == want
        c = s3_proxy.reset()
        no_faults_seen(c)
        got[gap] = (shard_gets(c, m, prefix), sum(c.bytes_by_key[f"{prefix}/{s.path}"] for s in m.shards))
    return got, len(want)


def test_neighbouring_samples_of_a_tar_shard_are_one_request(tmp_path_factory, s3_server, s3_proxy, monkeypatch):  # noqa: F811
    """Remote tar shards are read sample by sample; a batch's samples of one shard that lie
    within the coalescing gap of each other are one ranged GET (issue 38). In order (an
    evaluation pass), a batch of 16 neighbours is one request, where it was 16; the batches are
    the same either way, and SHARDTOOL_COALESCE_GAP=-1 reads every sample by itself."""
    src, url, m = stdlib_remote(tmp_path_factory, s3_server, "tar", format="tar", shard_size=1_000_000)
    got, batches = read_with_and_without_coalescing(s3_proxy, monkeypatch, src, url, m, "counts/tar", batch_size=16)
    print(
        f"tar shards, {batches} batches of 16 in order: ranged GETs each sample alone {got['-1'][0]}, coalesced {got[None][0]}"
    )
    assert got["-1"][0] == m.num_samples  # one per sample
    # One per batch and shard it touches: a batch in order spans at most two shards.
    assert got[None][0] <= batches + len(m.shards)


def test_consecutive_record_batches_of_a_remote_arrow_shard_are_one_request(
    tmp_path_factory,
    s3_server,  # noqa: F811
    s3_proxy,  # noqa: F811
    monkeypatch,
):
    """A training batch's missing record batches of one shard are fetched in runs: read in
    order, a batch of 64 samples over several consecutive record batches of 64 KiB is one ranged
    GET per shard it touches, not one per record batch; the same batches, the same bytes."""
    src, url, m = stdlib_remote(
        tmp_path_factory, s3_server, "rb", format="arrow", shard_size=2_000_000, record_batch_size="64KiB"
    )
    got, batches = read_with_and_without_coalescing(s3_proxy, monkeypatch, src, url, m, "counts/rb", batch_size=64)
    print(
        f"remote Arrow in order: (ranged GETs, shard bytes) each record batch alone {got['-1']}, coalesced {got[None]}"
    )
    assert got[None][0] <= batches + len(m.shards) + OPEN_ARROW * len(m.shards) < got["-1"][0]
    assert got[None][1] <= got["-1"][1]
