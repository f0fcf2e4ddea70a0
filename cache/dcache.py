"""The loader's view of the cache: a Dataset whose metadata and shards come from the node-local
cache, fetched from the source on a miss under the same per-shard locks as the warmer.

A cache this process may not write (warmed by root, read by the job's user) is read as it is;
its misses go to the user's own cache (:mod:`cache.usercache`), with one warning per process.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypedDict, TypeVar

import fsspec
import numpy as np

from ..format.dataset import Dataset
from ..format.manifest import MANIFEST_NAME, lengths_from_bytes, manifest_hash
from ..format.sindex import ShardIndex
from .budget import Budget
from .cachedir import SOURCES_NAME, VersionDir, record_source, recorded_version
from .errors import BudgetError, NotCached, RemoteError
from .locks import read_lock
from .meta import COPIED, FetchOptions, ensure_index, ensure_lengths, ensure_shard, ensure_summaries, store_manifest
from .perms import DEFAULT_PERMS, Perms
from .plain import PLAIN, cached_size, keeps_compressed, wants_plain
from .retry import RetryPolicy
from .store import Origin
from .usercache import can_write, own_cache_dir, user_cache_dir

_T = TypeVar("_T")


class CachedDataset(Dataset):
    """A Dataset rooted at the cache's version directory; misses are fetched from the source."""

    def __init__(self, cache: DatasetCache, manifest_bytes: bytes, **kw):
        self._cache = cache
        super().__init__(
            cache.vdir.root, fs=fsspec.filesystem("file"), root=cache.vdir.root, manifest_bytes=manifest_bytes, **kw
        )
        self.url = cache.url

    @property
    def lengths(self):
        if self._lengths is None:
            data = self._cache.metadata(lambda vd, src: ensure_lengths(vd, self.manifest, src, **self._cache.kw))
            self._lengths = lengths_from_bytes(data, expected=self.manifest.num_samples, source=self.url)
        return self._lengths

    def load_index_bytes(self, shard: int) -> bytes:
        info = self.manifest.shards[shard]
        return self._cache.metadata(lambda vd, src: ensure_index(vd, info, src, **self._cache.kw))

    def read_summaries_bytes(self) -> bytes | None:
        return self._cache.metadata(lambda vd, src: ensure_summaries(vd, src, self.manifest, **self._cache.kw))

    # A rank plans from its range's lengths: the sample indexes of its node's shards, which the
    # warmer cached, rather than the dataset-wide lengths file (O(dataset) to fetch and hash).
    def lengths_range(self, lo: int, hi: int):
        if self._lengths is not None:
            return self._lengths[lo:hi]
        self._fetch_indexes(lo, hi)
        return self.lengths_from_indexes(lo, hi)

    def _fetch_indexes(self, lo: int, hi: int, jobs: int = 64) -> None:
        """On a cold cache, fetch the range's sample indexes concurrently, not one request after
        another: the first plan waits for all of them (256 indexes at 50 ms a request: 1.0 s with 16
        threads, 0.3 s with 64; small requests, latency-bound)."""
        offsets = self._offsets
        first = max(int(np.searchsorted(offsets, lo, side="right")) - 1, 0)
        last = min(int(np.searchsorted(offsets, hi, side="left")), self.num_shards)
        missing = [
            s
            for s in range(first, last)
            if s not in self._indexes and not os.path.exists(self._cache.vdir.path(self.manifest.shards[s].index))
        ]
        if len(missing) > 1:
            with ThreadPoolExecutor(min(jobs, len(missing)), thread_name_prefix="shardtool-index") as pool:
                list(pool.map(self.load_index_bytes, missing))

    def shard_lengths(self, shard: int):
        return None  # the index is the source of the lengths here: nothing to compare it with

    def shard_path(self, shard: int) -> str:
        return self._cache.shard_path(shard)

    def shard_fs(self, shard: int):
        return self.fs  # the cache's copy, even of a tar indexed in place elsewhere

    def make_present(self, shard: int) -> None:
        self._cache.local_shard(shard)  # its path here is shard_path's, in the cache

    def held_plain(self, shard: int) -> bool:
        return self._cache.is_plain(shard)

    def shard_compressed(self, shard: int) -> bool:
        """Whether the cached copy is compressed: a compressed shard is cached plain unless the
        node keeps shards compressed (`cache.plain`); ask after the shard was made present."""
        return super().shard_compressed(shard) and not self._cache.is_plain(shard)


class DatasetCache:
    """One dataset version in one cache directory. Thread-safe; one per process is enough.

    ``read_only``: this process may not write the cache; what it lacks is fetched into the
    user's own cache ``user_cache`` (default: :func:`cache.usercache.user_cache_dir`)."""

    def __init__(
        self,
        url: str,
        cache_dir: str,
        version: str,
        manifest_bytes: bytes,
        *,
        storage_options: dict | None = None,
        source: Origin | None = None,
        retry: RetryPolicy = RetryPolicy(),
        max_bytes: int | None = None,
        min_free: int | None = None,
        allow_pickle: bool = False,
        perms: Perms = DEFAULT_PERMS,
        user_cache: str | None = None,
    ):
        self.url = url
        self.cache_dir = os.path.abspath(cache_dir)
        self.vdir = VersionDir(cache_dir, version, perms)
        self.read_only = not can_write(self.vdir.root if os.path.isdir(self.vdir.root) else self.cache_dir)
        self.user_cache = user_cache or user_cache_dir(os.environ)
        self._user: VersionDir | None = None  # the user's own cache, once known to exist
        self._user_lock = threading.Lock()
        self._filling_user = False  # a miss was fetched into the user's cache (warned, recorded)
        self._where: dict[int, VersionDir] = {}  # shard -> the cache holding its trusted copy
        self._plain: set[int] = set()  # shards whose trusted copy is plain (decompressed on the way in)
        self.version = version
        self.storage_options = storage_options
        self._source = source
        self._source_failed = False
        self.retry = retry
        self.budget = Budget(max_bytes, min_free)  # the one owner of the limits
        self.kw: FetchOptions = {"policy": retry, "deadline": None}
        self.dataset = CachedDataset(self, manifest_bytes, allow_pickle=allow_pickle)
        self.manifest = self.dataset.manifest
        self.fetched_bytes = 0  # shard bytes this object copied from the source (fetch-on-miss)
        self._copied: dict[int, int] = {}  # shard -> bytes copied, until a read claims it (`take_copied`)
        self._count_lock = threading.Lock()  # misses are fetched on several threads at once

    def source(self) -> Origin | None:
        """The source filesystem, opened lazily (None if it cannot even be opened)."""
        if self._source is None and not self._source_failed:
            try:
                self._source = Origin(self.url, self.storage_options)
            except Exception:  # noqa: BLE001 - an unusable source means "cache only"
                self._source_failed = True
        return self._source

    # ------------------------------------------------------- where things are
    def _user_vdir(self, *, create: bool) -> VersionDir | None:
        """The user's own cache for this version (only for a read-only cache); None while it does
        not exist and ``create`` is false. Creating it warns once: the job reads a cache it
        cannot fill, which a site may want to fix in its prolog."""
        if not self.read_only:
            return None
        with self._user_lock:
            if self._user is None:
                root = own_cache_dir(self.user_cache, create=create)
                if root is None:
                    return None
                self._user = VersionDir(root, self.version)
            if create and not self._filling_user:
                self._filling_user = True
                warnings.warn(
                    f"shardtool cache {self.cache_dir} is not writable by this user (uid {os.geteuid()}): "
                    f"what it lacks is fetched into the user cache {self._user.cache_dir} "
                    "(set SHARDTOOL_USER_CACHE to choose where)",
                    RuntimeWarning,
                    stacklevel=3,
                )
                # so that an offline start finds what lands there
                store_manifest(self._user, self.dataset.manifest_bytes)
                record_source(self._user.cache_dir, self.url, self.version)
            return self._user

    def _store(self) -> VersionDir:
        """Where a miss is fetched to: this cache, or the user's own when this one is read-only."""
        if not self.read_only:
            return self.vdir
        user = self._user_vdir(create=True)
        # own_cache_dir(create=True) made the directory or raised LocalFault: it exists
        if user is None:
            raise RuntimeError(f"shardtool internal error: user cache {self.user_cache} vanished as it was created")
        return user

    def _holder(self, shard: int) -> VersionDir | None:
        for vd in (self.vdir, self._user_vdir(create=False)):
            if vd is not None and self._trusted(vd, shard):
                self._where[shard] = vd
                return vd
        return None

    def _trusted(self, vd: VersionDir, shard: int) -> bool:
        """Trusted in ``vd``; remembers which form the copy has (stored or plain)."""
        form = vd.trusted_form(shard, self.manifest.shards[shard])
        if form == PLAIN:
            self._plain.add(shard)
        else:
            self._plain.discard(shard)
        return form is not None

    def is_plain(self, shard: int) -> bool:
        """The trusted copy last seen of ``shard`` is a compressed shard's plain copy."""
        return shard in self._plain

    def keep_compressed(self, store: VersionDir) -> bool:
        """Fetch-on-miss follows the node's warm: plain unless it ran with --keep-compressed."""
        return keeps_compressed(store)

    def metadata(self, fetch: Callable[[VersionDir, Origin | None], _T]) -> _T:
        """A small metadata file, ``fetch(vdir, source)``: from this cache, or where misses go."""
        if self.read_only:
            for vd in (self.vdir, self._user_vdir(create=False)):
                if vd is not None:
                    with contextlib.suppress(NotCached):
                        return fetch(vd, None)  # no source: read what is there, write nothing
        return fetch(self._store(), self.source())

    def shard_path(self, shard: int) -> str:
        return self._where.get(shard, self.vdir).path(self.manifest.shards[shard].path)

    def is_cached(self, shard: int) -> bool:
        return self._holder(shard) is not None

    def take_copied(self, shard: int) -> int:
        """Bytes of ``shard`` this object copied from the source and no read claimed yet (0 if none),
        now claimed: the first open after a fetch is the miss, whichever thread fetched it."""
        with self._count_lock:
            return self._copied.pop(shard, 0)

    def local_shard(self, shard: int) -> str:
        """Path of a verified local copy of ``shard``, fetched into the cache on a miss."""
        info = self.manifest.shards[shard]
        held = self._holder(shard)
        if held is not None:
            return held.path(info.path)
        src = self.source()
        if src is None:
            raise NotCached(
                f"shard #{shard} {info.path} is not in the cache {self.vdir.root} "
                f"and the source {self.url} cannot be opened"
            )
        store = self._store()
        self._make_room(shard, store)
        try:
            plain = wants_plain(self.manifest, self.keep_compressed(store))
            if ensure_shard(store, shard, info, src, plain=plain, **self.kw) == COPIED:
                with self._count_lock:
                    self.fetched_bytes += info.bytes
                    self._copied[shard] = self._copied.get(shard, 0) + info.bytes
        except RemoteError as e:
            raise NotCached(
                f"shard #{shard} {info.path} is not in the cache {store.root} and fetching it failed: {e}"
            ) from e
        self._where[shard] = store
        self._trusted(store, shard)
        return store.path(info.path)

    def _make_room(self, shard: int, store: VersionDir) -> None:
        if not self.budget.active:
            return
        size = cached_size(self.manifest, self.manifest.shards[shard], self.keep_compressed(store))
        room = self.budget.measure(store.cache_dir, current=store, protected={shard})
        _, _, short = room.make_room(size)
        if short:
            raise BudgetError(
                f"shard #{shard} {self.manifest.shards[shard].path} ({size} bytes) does not fit in the "
                f"cache budget of {room.limit} bytes: {short} bytes short after evicting every shard not "
                "in use (shards being read are never evicted)",
                needed=room.limit + short,
                available=room.limit,
            )

    @contextlib.contextmanager
    def reading(self, shard: int) -> Iterator[str]:
        """Hold a shared lock on the shard while it is read: eviction (which needs the exclusive
        lock) keeps away; yields the local path, fetching it first on a miss."""
        while True:
            path = self.local_shard(shard)
            vd = self._where[shard]
            with read_lock(vd.lock_path(shard), perms=vd.perms):
                if self._trusted(vd, shard):
                    vd.touch(shard)
                    yield path
                    return
            # evicted between the fetch and the lock: fetch again

    def shard_index(self, shard: int) -> ShardIndex:
        return self.dataset.shard_index(shard)


def _read_source_manifest(url: str, storage_options: dict | None, retry: RetryPolicy) -> tuple[Origin, bytes] | None:
    try:
        src = Origin(url, storage_options)
        # One quick try: an unreachable source must not stall the loader's start; the cache has it.
        quick = RetryPolicy(attempts=1, attempt_timeout=retry.stall_timeout, stall_timeout=retry.stall_timeout)
        return src, src.read_bytes(MANIFEST_NAME, policy=quick)
    except (RemoteError, OSError, ImportError, ValueError):
        return None


def _offline(cache_dir: str, url: str) -> tuple[str, bytes]:
    """(version, manifest bytes) recorded for ``url`` in ``cache_dir``; NotCached says why not."""
    version = recorded_version(cache_dir, url)
    if version is None:
        sources = os.path.join(cache_dir, SOURCES_NAME)
        why = (
            f"; {sources} exists but this user cannot read it (warm it again to give it the cache's mode)"
            if os.path.exists(sources) and not os.access(sources, os.R_OK)
            else ""
        )
        raise NotCached(
            f"source {url} is unreachable and the cache {cache_dir} has no record of it "
            f"(sources.json){why}; run `shardtool warm` while the source is reachable"
        )
    vd = VersionDir(cache_dir, version)
    try:
        with open(vd.manifest_path, "rb") as f:
            manifest_bytes = f.read()
    except OSError:
        raise NotCached(f"source {url} is unreachable and its cached manifest {vd.manifest_path} is missing") from None
    if manifest_hash(manifest_bytes) != version:
        raise NotCached(f"cached manifest {vd.manifest_path} does not match its version {version}")
    return version, manifest_bytes


class _CacheOptions(TypedDict):
    """`DatasetCache`'s keyword arguments that `open_cache` passes through as given."""

    storage_options: dict | None
    retry: RetryPolicy
    max_bytes: int | None
    min_free: int | None
    allow_pickle: bool
    perms: Perms
    user_cache: str | None


def open_cache(
    url: str,
    cache_dir: str,
    *,
    storage_options: dict | None = None,
    retry: RetryPolicy = RetryPolicy(),
    max_bytes: int | None = None,
    min_free: int | None = None,
    allow_pickle: bool = False,
    perms: Perms = DEFAULT_PERMS,
    user_cache: str | None = None,
) -> DatasetCache:
    """Open ``url`` through the node-local cache in ``cache_dir``.

    The manifest comes from the source when it answers (and is stored in the cache); otherwise
    the version the warmer recorded for this URL in ``cache_dir/sources.json`` is opened from the
    cache alone. Raises NotCached if neither is possible. A cache this process may not write is
    only read; its misses go to ``user_cache`` (see :mod:`cache.usercache`).
    """
    with contextlib.suppress(OSError):  # one this process cannot create is read through the user cache
        perms.makedirs(cache_dir)
    kw: _CacheOptions = {
        "storage_options": storage_options,
        "retry": retry,
        "max_bytes": max_bytes,
        "min_free": min_free,
        "allow_pickle": allow_pickle,
        "perms": perms,
        "user_cache": user_cache,
    }
    found = _read_source_manifest(url, storage_options, retry)
    if found is not None:
        src, manifest_bytes = found
        cache = DatasetCache(url, cache_dir, manifest_hash(manifest_bytes), manifest_bytes, source=src, **kw)
        if not cache.read_only:
            store_manifest(cache.vdir, manifest_bytes)
            record_source(cache_dir, url, cache.version, perms=perms)
        return cache
    try:
        version, manifest_bytes = _offline(cache_dir, url)
    except NotCached:
        # what this user fetched before, beside a cache it cannot write
        user = own_cache_dir(user_cache or user_cache_dir(os.environ), create=False)
        if user is None or can_write(cache_dir) or recorded_version(user, url) is None:
            raise
        version, manifest_bytes = _offline(user, url)
    return DatasetCache(url, cache_dir, version, manifest_bytes, **kw)


__all__ = ["CachedDataset", "DatasetCache", "open_cache"]
