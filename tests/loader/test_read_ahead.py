"""Reading ahead in plan order without a node cache (issue 38 item 3, loader/readahead.py).

The order in which a process starts fetches is pure (`ReadAhead` over any batches); what the loader
fetches is checked against a real S3 API (moto through the counting proxy of
tests/helpers/s3proxy.py) with real text: the record batches of the batches after the one served
are asked for before those batches are, and none is fetched twice.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from helpers.s3proxy import s3_proxy, stdlib_dataset  # noqa: F401  (fixture)
from helpers.s3server import s3_server  # noqa: F401  (fixture)
from shardtool.format import FormatError, open_dataset
from shardtool.loader import ShardedLoader
from shardtool.loader.batchcache import pending_fetches
from shardtool.loader.cachefill import FILL_AHEAD
from shardtool.loader.readahead import ReadAhead, read_ahead

pytestmark = pytest.mark.timeout(240)  # the moto server is a subprocess
PREFIX = "readahead/ds"


class Recorder:
    """A reader as read-ahead sees it: it records which batch's samples it was asked to fetch."""

    def __init__(self, log: list):
        self.log = log

    def fetch_ahead(self, ids: np.ndarray) -> None:
        self.log.append(("fetch", int(ids[0])))


class Batches:
    """``n`` batches; batch b is the one sample id b; ``broken``: batches whose reads raise."""

    def __init__(self, n: int, log: list, broken: tuple[int, ...] = (), remote: bool = True):
        self.n, self.log, self.broken, self.remote = n, log, broken, remote
        self.reader = Recorder(log)

    def __len__(self) -> int:
        return self.n

    def reads(self, b: int) -> list:
        if b in self.broken:
            raise FormatError(f"batch {b}: its shard's index does not match the manifest")
        return [(self.reader, np.array([b]))]

    def ahead_depth(self, prefetch: int) -> int:
        return prefetch if self.remote else 0

    def load(self, b: int, alloc=None):
        self.log.append(("load", b))
        return b


def test_a_load_fetches_its_batch_first_then_the_ones_this_process_loads_next():
    log: list = []
    batches = Batches(9, log)
    load = read_ahead(batches.load, batches, stride=2, depth=2)  # a worker of 2: batches 1, 3, 5, ...
    assert load(3) == 3
    # its own batch before the load (every shard's requests wait together), then the two that
    # worker loads next, after it (they would compete with this batch's requests)
    assert log == [("fetch", 3), ("load", 3), ("fetch", 5), ("fetch", 7)]
    log.clear()
    load(7)
    assert log == [("fetch", 7), ("load", 7)]  # nothing past the pass's last batch


def test_a_batch_ahead_that_cannot_be_read_is_left_to_its_own_load_to_report():
    log: list = []
    batches = Batches(6, log, broken=(2,))
    load = ReadAhead(batches.load, batches, stride=1, depth=2)
    assert load(0) == 0 and log == [("fetch", 0), ("load", 0), ("fetch", 1)]


def test_local_reads_are_not_wrapped():
    batches = Batches(4, [], remote=False)
    assert read_ahead(batches.load, batches, stride=1, depth=2) == batches.load


def test_record_batches_held_in_memory_are_read_prefetch_factor_ahead_and_local_ones_not(served, s3_server):  # noqa: F811
    src, url = served
    kw = dict(batch_size=8, num_workers=0, rank=0, world_size=1)
    remote = ShardedLoader(url, storage_options=s3_server.storage_options, **kw)
    local = ShardedLoader(src, **kw)
    assert remote.readers[url].ahead_depth(3) == 3  # bounded by memory: what is fetched waits in it
    assert local.readers[src].ahead_depth(3) == 0
    remote.close()
    local.close()


# --------------------------------------------------------------------------- a real store
@pytest.fixture(scope="module")
def served(tmp_path_factory, s3_server):  # noqa: F811
    src = stdlib_dataset(str(tmp_path_factory.mktemp("readahead") / "ds"))
    return src, s3_server.upload(src, PREFIX)


@pytest.fixture(scope="module")
def second(tmp_path_factory, s3_server):  # noqa: F811
    """A second source for a mixture: fewer files, in larger shards."""
    src = stdlib_dataset(str(tmp_path_factory.mktemp("readahead") / "two"), files=80, shard_size=2_000_000)
    return src, s3_server.upload(src, "readahead/two")


def settled(timeout: float = 30.0) -> None:
    """Every fetch this process started ahead has come back."""
    deadline = time.monotonic() + timeout
    while not all(f.done() for f in pending_fetches().values()):
        assert time.monotonic() < deadline, "fetches started ahead never came back"
        time.sleep(0.01)


def plain(batch: dict) -> dict:
    return {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


@pytest.mark.parametrize("batch_size", [4, 16])
def test_the_next_batches_are_fetched_ahead_once_and_served_the_same(served, s3_proxy, batch_size):  # noqa: F811
    src, url = served
    kw = dict(batch_size=batch_size, num_workers=0, prefetch_factor=2, seed=3, rank=0, world_size=1)
    want = [plain(b) for b in ShardedLoader(src, **kw)]
    ds = open_dataset(src)
    shard_of = {k: ds.manifest.shards[s].path for s in range(len(ds.manifest.shards)) for k in ds.shard_index(s).keys}
    key = lambda rel: f"{PREFIX}/{rel}"  # noqa: E731

    ld = ShardedLoader(url, storage_options=s3_proxy.storage_options, **kw)
    it = iter(ld)
    s3_proxy.reset()
    got = [plain(next(it))]
    settled()
    asked = s3_proxy.reset()
    # batches 1 and 2 were asked for ahead of their next(): each of their shards got a ranged read
    for b in (1, 2):
        for k in want[b]["__key__"]:
            assert asked.by_key_kind[(key(shard_of[k]), "RANGED_GET")] >= 1, (b, k)
    got += [plain(b) for b in it]
    assert got == want
    # and nothing was fetched twice: the shards' bytes read over the pass are about their size
    c = s3_proxy.reset()
    read = asked.bytes_by_key.total() + c.bytes_by_key.total()
    stored = sum(s.bytes for s in ds.manifest.shards)
    assert read <= 1.05 * stored, f"{read / stored:.2f}x the shards' bytes read"
    ld.close()
    assert not pending_fetches()


def test_the_first_batches_are_fetched_once_before_the_fork_and_the_workers_inherit_them(served, s3_proxy):  # noqa: F811
    """The workers' first batches are fetched by the rank's process before they fork
    (loader/remotefetch.py `hand_down`): every worker inherits them, so a record batch they
    share is fetched once, where each worker fetched its own copy (here the first 4 batches of 16
    touch most shards, so without it both workers fetch nearly every shard: ~2x the bytes)."""
    src, url = served
    kw = dict(batch_size=16, num_workers=2, prefetch_factor=2, seed=3, rank=0, world_size=1)
    want = [plain(b) for b in ShardedLoader(src, **kw)]
    ds = open_dataset(src)
    data = {f"{PREFIX}/{info.path}" for info in ds.manifest.shards}
    ld = ShardedLoader(url, storage_options=s3_proxy.storage_options, **kw)
    s3_proxy.reset()
    assert [plain(b) for b in ld] == want
    c = s3_proxy.reset()
    read = sum(n for k, n in c.bytes_by_key.items() if k in data)
    stored = sum(s.bytes for s in ds.manifest.shards)
    assert read <= 1.3 * stored, f"{read / stored:.2f}x the shards' bytes read by 2 workers"
    ld.close()


def test_a_ranks_sample_indexes_are_fetched_from_its_construction_and_once(served, s3_proxy):  # noqa: F811
    """The rank's own indexes are known from its range before any plan: their fetch starts when
    the loader is made (behind the trainer's set-up), and neither the fetch before the workers
    fork nor the workers ask for one again."""
    src, url = served
    manifest = open_dataset(src).manifest
    keys = {f"{PREFIX}/{info.index}" for info in manifest.shards}

    def index_gets() -> dict:
        c = s3_proxy.counts()
        out: dict = {}
        for (k, kind), n in c.by_key_kind.items():
            if k in keys and kind in ("GET", "RANGED_GET"):
                out[k] = out.get(k, 0) + n
        return out

    s3_proxy.reset()
    ld = ShardedLoader(
        url,
        storage_options=s3_proxy.storage_options,
        batch_size=8,
        num_workers=2,
        seed=1,
        rank=1,
        world_size=2,
        ranks_per_node=1,  # a node a rank: its own range is its node's, half the shards
    )
    own = set(ld.batch_source.reader.locate(ld.batch_source.plan.ids)[0].tolist())  # (the plan reads no index)
    assert 0 < len(own) < len(keys)
    deadline = time.monotonic() + 30
    while set(index_gets()) != {f"{PREFIX}/{manifest.shards[s].index}" for s in own}:
        assert time.monotonic() < deadline, f"no early fetch of the rank's indexes: {sorted(index_gets())}"
        time.sleep(0.01)
    served_keys = [k for batch in ld for k in batch["__key__"]]
    assert len(served_keys) == len(set(served_keys)) > 0
    assert set(index_gets().values()) == {1}  # each index fetched once: early, then never again
    ld.close()


@pytest.mark.parametrize(
    "kind", [dict(max_tokens=240_000), dict(seq_len=2048, batch_size=4, packing="best-fit", token_fields=[])]
)
@pytest.mark.parametrize("workers", [0, 2])
def test_a_mixture_of_remote_sources_reads_ahead_the_same_steps(served, second, s3_proxy, kind, workers):  # noqa: F811
    from shardtool.plan.mixture import Mixture

    (src, url), (other, other_url) = served, second
    kw = dict(steps=12, num_workers=workers, seed=1, rank=0, world_size=1, **kind)

    def steps(a, b, **opts):
        ld = ShardedLoader(Mixture({"a": (a, 0.5), "b": (b, 0.5)}), **kw, **opts)
        return [(x["__source__"], x["__key__"]) for x in ld]

    assert steps(url, other_url, storage_options=s3_proxy.storage_options) == steps(src, other)


SECOND_LOADER = """
import json, sys
from shardtool.loader import ShardedLoader

url, opts = sys.argv[1], json.loads(sys.argv[2])
for _ in range(2):  # the first loader is dropped, not collected, when the second forks its workers
    ld = ShardedLoader(url, storage_options=opts, batch_size=8, num_workers=2, seed=0, rank=0, world_size=1)
    print(sum(len(b["__key__"]) for b in ld))
    ld.close()
"""


def test_a_second_remote_loader_s_workers_leave_the_first_one_s_session_alone(served, s3_proxy, tmp_path):  # noqa: F811
    """Garbage the trainer left (the first loader's s3fs session) is not collected in the second
    loader's workers: its finalizer there printed "Task exception was never retrieved ...
    attached to a different loop" from every worker."""
    src, url = served
    n = open_dataset(src).manifest.num_samples
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", SECOND_LOADER, url, json.dumps(s3_proxy.storage_options)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(n), str(n)]
    assert "Traceback" not in proc.stderr and "never retrieved" not in proc.stderr, proc.stderr


# --------------------------------------------------------------------------- a node cache, fetch on a miss
def test_an_empty_node_cache_fetches_the_next_batches_shards_ahead_once(served, s3_proxy, tmp_path):  # noqa: F811
    """A cache that was not warmed: the shards a batch lacks are fetched together, and the next
    batches' while the trainer steps (loader/cachefill.py); each shard once, whole."""
    from shardtool.cache import open_cache

    src, url = served
    kw = dict(batch_size=8, num_workers=0, prefetch_factor=2, seed=5, rank=0, world_size=1)
    want = [plain(b) for b in ShardedLoader(src, **kw)]
    ds = open_dataset(src)
    shard_of = {k: s for s in range(len(ds.manifest.shards)) for k in ds.shard_index(s).keys}
    cache_dir = str(tmp_path / "cache")
    ld = ShardedLoader(url, storage_options=s3_proxy.storage_options, cache_dir=cache_dir, **kw)
    it = iter(ld)
    got = [plain(next(it))]
    # the next FILL_AHEAD batches were started before their next(), not prefetch_factor's 2 (what
    # is fetched lands on disk): their shards arrive without it
    assert ld.readers[url].ahead_depth(2) == FILL_AHEAD
    ahead = {shard_of[k] for b in range(1, min(FILL_AHEAD, len(want) - 1) + 1) for k in want[b]["__key__"]}
    assert len(ahead) > len({shard_of[k] for b in (1, 2) for k in want[b]["__key__"]})
    cache = open_cache(url, cache_dir, storage_options=s3_proxy.storage_options)
    deadline = time.monotonic() + 30
    while not all(cache.is_cached(s) for s in ahead):
        assert time.monotonic() < deadline, f"shards {sorted(s for s in ahead if not cache.is_cached(s))} never arrived"
        time.sleep(0.02)
    got += [plain(b) for b in it]
    ld.close()
    assert got == want
    c = s3_proxy.counts()
    for s in ds.manifest.shards:  # each shard whole, once: no fetch raced another of the same shard
        assert c.by_key_kind[(f"{PREFIX}/{s.path}", "RANGED_GET")] == 1, s.path
        assert c.bytes_by_key[f"{PREFIX}/{s.path}"] == s.bytes


def test_a_shard_gone_from_the_store_is_named_by_the_read_that_needs_it(tmp_path, s3_server):  # noqa: F811
    """A fetch started ahead that fails is not the error: the batch's own read tries again and
    raises, naming the shard."""
    src = stdlib_dataset(str(tmp_path / "ds"), files=60)
    url = s3_server.upload(src, "readahead-gone/ds")
    m = open_dataset(src).manifest
    gone = m.shards[1].path
    s3_server.fs().rm(f"readahead-gone/ds/{gone}")
    ld = ShardedLoader(
        url, storage_options=s3_server.storage_options, cache_dir=str(tmp_path / "c"), batch_size=4, num_workers=0
    )
    from shardtool.cache.errors import NotCached

    with pytest.raises(NotCached, match=f"{gone} is not in the cache .* not found in the source"):
        for _ in ld:
            pass
    ld.close()
