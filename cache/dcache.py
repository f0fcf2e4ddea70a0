"""The loader's view of the cache: a Dataset whose metadata and shards come from the node-local
cache, fetched from the source on a miss under the same per-shard locks as the warmer.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import fsspec

from ..format.dataset import Dataset
from ..format.manifest import MANIFEST_NAME, lengths_from_bytes, manifest_hash
from ..format.sindex import ShardIndex

from .budget import disk_free, evict, scan
from .errors import BudgetError, NotCached, RemoteError
from .evict import effective_limit, plan_eviction
from .layout import VersionDir, record_source, recorded_version
from .locks import locked
from .meta import COPIED, ensure_index, ensure_lengths, ensure_shard, store_manifest
from .retry import RetryPolicy
from .store import Source


class CachedDataset(Dataset):
    """A Dataset rooted at the cache's version directory; misses are fetched from the source."""

    def __init__(self, cache: "DatasetCache", manifest_bytes: bytes, **kw):
        self._cache = cache
        super().__init__(cache.vdir.root, fs=fsspec.filesystem("file"), root=cache.vdir.root,
                         manifest_bytes=manifest_bytes, **kw)
        self.url = cache.url

    @property
    def lengths(self):
        if self._lengths is None:
            data = ensure_lengths(self._cache.vdir, self.manifest, self._cache.source(), **self._cache.kw)
            self._lengths = lengths_from_bytes(data, expected=self.manifest.num_samples, source=self.url)
        return self._lengths

    def load_index_bytes(self, shard: int) -> bytes:
        return ensure_index(self._cache.vdir, self.manifest.shards[shard], self._cache.source(), **self._cache.kw)

    # A shard is made present in the cache (fetched on a miss) before the base class opens it;
    # its path there is the base class's shard_path.
    def _range(self, shard: int):
        if shard not in self._ranges:
            self._cache.local_shard(shard)
        return super()._range(shard)

    def _arrow_reader(self, shard: int):
        self._cache.local_shard(shard)
        return super()._arrow_reader(shard)


class DatasetCache:
    """One dataset version in one cache directory. Thread-safe; one per process is enough."""

    def __init__(self, url: str, cache_dir: str, version: str, manifest_bytes: bytes, *,
                 storage_options: dict | None = None, source: Source | None = None,
                 retry: RetryPolicy = RetryPolicy(), max_bytes: int | None = None, min_free: int | None = None,
                 allow_pickle: bool = False):
        self.url = url
        self.cache_dir = os.path.abspath(cache_dir)
        self.vdir = VersionDir(cache_dir, version)
        self.version = version
        self.storage_options = storage_options
        self._source = source
        self._source_failed = False
        self.retry = retry
        self.max_bytes, self.min_free = max_bytes, min_free
        self.kw = {"policy": retry, "deadline": None}
        self.dataset = CachedDataset(self, manifest_bytes, allow_pickle=allow_pickle)
        self.manifest = self.dataset.manifest
        self.fetched_bytes = 0  # shard bytes this object copied from the source (fetch-on-miss)

    def source(self) -> Source | None:
        """The source filesystem, opened lazily (None if it cannot even be opened)."""
        if self._source is None and not self._source_failed:
            try:
                self._source = Source(self.url, self.storage_options)
            except Exception:  # noqa: BLE001 - an unusable source means "cache only"
                self._source_failed = True
        return self._source

    def shard_path(self, shard: int) -> str:
        return self.vdir.path(self.manifest.shards[shard].path)

    def is_cached(self, shard: int) -> bool:
        return self.vdir.trusted(shard, self.manifest.shards[shard])

    def local_shard(self, shard: int) -> str:
        """Path of a verified local copy of ``shard``, fetched into the cache on a miss."""
        info = self.manifest.shards[shard]
        if self.vdir.trusted(shard, info):
            return self.vdir.path(info.path)
        src = self.source()
        if src is None:
            raise NotCached(f"shard #{shard} {info.path} is not in the cache {self.vdir.root} "
                            f"and the source {self.url} cannot be opened")
        self._make_room(shard)
        try:
            if ensure_shard(self.vdir, shard, info, src, **self.kw) == COPIED:
                self.fetched_bytes += info.bytes
        except RemoteError as e:
            raise NotCached(f"shard #{shard} {info.path} is not in the cache {self.vdir.root} and fetching it "
                            f"failed: {e}") from e
        return self.vdir.path(info.path)

    def _make_room(self, shard: int) -> None:
        if self.max_bytes is None and self.min_free is None:
            return
        size = self.manifest.shards[shard].bytes
        entries, where, used = scan(self.cache_dir, current=self.vdir, protected={shard})
        limit = effective_limit(used, disk_free(self.cache_dir), max_bytes=self.max_bytes, min_free=self.min_free)
        if limit is None or used + size <= limit:
            return
        need = used + size - limit
        _, shortfall = plan_eviction(entries, used=used, limit=limit, incoming=size)
        if not shortfall:
            # Shards other processes are reading are skipped by evict(): it may free less than planned.
            freed, _ = evict(where, entries, need)
            if freed >= need:
                return
            shortfall = need - freed
        raise BudgetError(f"shard #{shard} {self.manifest.shards[shard].path} ({size} bytes) does not fit in the "
                          f"cache budget of {limit} bytes: {shortfall} bytes short after evicting every shard not "
                          "in use (shards being read are never evicted)", needed=used - need + shortfall + size,
                          available=limit)

    @contextlib.contextmanager
    def reading(self, shard: int) -> Iterator[str]:
        """Hold a shared lock on the shard while it is read: eviction (which needs the exclusive
        lock) keeps away; yields the local path, fetching it first on a miss."""
        while True:
            path = self.local_shard(shard)
            with locked(self.vdir.lock_path(shard), shared=True):
                if self.vdir.trusted(shard, self.manifest.shards[shard]):
                    self.vdir.touch(shard)
                    yield path
                    return
            # evicted between the fetch and the lock: fetch again

    def shard_index(self, shard: int) -> ShardIndex:
        return self.dataset.shard_index(shard)


def _read_source_manifest(url: str, storage_options: dict | None, retry: RetryPolicy) -> tuple[Source, bytes] | None:
    try:
        src = Source(url, storage_options)
        # One quick try: an unreachable source must not stall the loader's start; the cache has it.
        quick = RetryPolicy(attempts=1, attempt_timeout=retry.stall_timeout, stall_timeout=retry.stall_timeout)
        return src, src.read_bytes(MANIFEST_NAME, policy=quick)
    except (RemoteError, OSError, ImportError, ValueError):
        return None


def open_cache(url: str, cache_dir: str, *, storage_options: dict | None = None, retry: RetryPolicy = RetryPolicy(),
               max_bytes: int | None = None, min_free: int | None = None, allow_pickle: bool = False) -> DatasetCache:
    """Open ``url`` through the node-local cache in ``cache_dir``.

    The manifest comes from the source when it answers (and is stored in the cache); otherwise
    the version the warmer recorded for this URL in ``cache_dir/sources.json`` is opened from the
    cache alone. Raises NotCached if neither is possible.
    """
    os.makedirs(cache_dir, exist_ok=True)
    found = _read_source_manifest(url, storage_options, retry)
    if found is not None:
        src, manifest_bytes = found
        cache = DatasetCache(url, cache_dir, manifest_hash(manifest_bytes), manifest_bytes,
                             storage_options=storage_options, source=src, retry=retry,
                             max_bytes=max_bytes, min_free=min_free, allow_pickle=allow_pickle)
        store_manifest(cache.vdir, manifest_bytes)
        record_source(cache_dir, url, cache.version)
        return cache
    version = recorded_version(cache_dir, url)
    if version is None:
        raise NotCached(f"source {url} is unreachable and the cache {cache_dir} has no record of it "
                        "(sources.json); run `shardtool warm` while the source is reachable")
    vd = VersionDir(cache_dir, version)
    try:
        with open(vd.manifest_path, "rb") as f:
            manifest_bytes = f.read()
    except OSError:
        raise NotCached(f"source {url} is unreachable and its cached manifest {vd.manifest_path} is missing") from None
    if manifest_hash(manifest_bytes) != version:
        raise NotCached(f"cached manifest {vd.manifest_path} does not match its version {version}")
    return DatasetCache(url, cache_dir, version, manifest_bytes, storage_options=storage_options, retry=retry,
                        max_bytes=max_bytes, min_free=min_free, allow_pickle=allow_pickle)


__all__ = ["CachedDataset", "DatasetCache", "open_cache"]
