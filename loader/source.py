"""Where shard bytes come from: the node-local cache, a local path, or a remote store.

This is the loader's seam to `shardtool.cache`: with a ``cache_dir`` a shard is a verified local
file in the cache (fetched on a miss, protected from eviction while open); without one, local
datasets are read in place, each shard verified before first use (loader/verify.py, which
borrows the cache's trust stamps), and remote ones by ranged requests through fsspec, each
sample checked against its index checksum.

A `SourceSpec` is the picklable recipe; each process (the trainer and every DataLoader worker)
opens its own `Source` from it, after fork, so no file handle or event loop is shared.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ..format import Dataset, FormatError, open_dataset
from ..format.dataset import is_local
from .observability.probe import CACHE, LOCAL, REMOTE

if TYPE_CHECKING:
    from .verify import InPlaceVerifier


@dataclass(frozen=True)
class SourceSpec:
    url: str
    cache_dir: str | None = None
    storage_options: dict | None = field(default=None, hash=False)

    def open(self, parent: Dataset | None = None) -> Source:
        """This process's source; ``parent``: the dataset the process it was forked from had open
        (a remote one without a cache is reopened from it: its metadata needs no new request)."""
        return Source(self, parent)


class ShardFile(Protocol):
    """A shard's bytes as a `ShardView` reads them: a `MappedFile`, a `RemoteShard` (no bytes), or
    a compressed shard decompressed into memory (`loader.inflate.InflatedShard`)."""

    @property
    def shard_name(self) -> str: ...

    @property
    def size(self) -> int: ...

    def buffer(self) -> mmap.mmap | bytes: ...

    def close(self) -> None: ...


class MappedFile:
    """A whole shard memory-mapped read-only; one per shard per process."""

    def __init__(self, path: str, shard_name: str, release=None):
        self.shard_name = shard_name
        self._release = release
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            self.close()
            raise FormatError(f"shard {shard_name}: cannot open {path} ({e.strerror})") from None
        try:
            self.stat = os.fstat(fd)  # of the file mapped, even if the path is replaced meanwhile
            size = self.stat.st_size
            # mmap refuses empty files; an empty shard has no samples to read anyway.
            self.mm = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None
        finally:
            os.close(fd)
        self.size = size

    def buffer(self) -> mmap.mmap | bytes:
        return self.mm if self.mm is not None else b""

    def close(self) -> None:
        mm, self.mm = getattr(self, "mm", None), None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                # A view handed to the caller still points into the map; the OS unmaps it
                # when that view is collected.
                pass
        release, self._release = self._release, None
        if release is not None:
            release()


class RemoteShard:
    """A remote shard read by ranges, in place of a `MappedFile` (no map: its record batches are
    fetched one by one, `ShardView`'s ``fetch``)."""

    size = 0

    def __init__(self, shard_name: str):
        self.shard_name = shard_name

    def buffer(self) -> bytes:
        return b""

    def close(self) -> None:
        pass


class Source:
    """Dataset metadata plus access to shard bytes, for one process."""

    @property
    def cache(self):
        """The node cache it reads through (`shardtool.cache.DatasetCache`), or None."""
        return self._cache

    def __init__(self, spec: SourceSpec, parent: Dataset | None = None):
        self.spec = spec
        self._cache = None
        self._verifier: InPlaceVerifier | None = None
        if spec.cache_dir:
            from ..cache import open_cache  # lazy: a loader without a cache never imports it
            from ..cache.jobs import check_job_finding

            # In a SLURM job whose prolog could not stage its data (the job's own mistake, which
            # must not fail the prolog and drain the node), say what the prolog found.
            check_job_finding(spec.cache_dir, spec.url, os.environ)
            self._cache = open_cache(spec.url, spec.cache_dir, storage_options=spec.storage_options)
            self.dataset: Dataset = self._cache.dataset
        elif parent is not None and not is_local(parent.fs):
            self.dataset = parent.reopened()
        else:
            self.dataset = open_dataset(spec.url, storage_options=spec.storage_options)
            if is_local(self.dataset.fs):
                # Made when the trainer opens the source, not at a worker's first shard: the
                # modules it imports (the cache's trust stamps) and its stamp directory are then
                # inherited by every forked worker instead of redone in each (~50 ms a worker).
                self._make_verifier()

    @property
    def local(self) -> bool:
        """Shards are local files (cache or local dataset): read by memory map."""
        return self._cache is not None or is_local(self.dataset.fs)

    @property
    def tier(self) -> int:
        """Where shard bytes come from: the node cache, a local path in place, or a remote store."""
        return CACHE if self._cache is not None else LOCAL if self.local else REMOTE

    @property
    def fetched_bytes(self) -> int:
        """Shard bytes this process fetched into the cache on a miss so far (0 without a cache)."""
        return self._cache.fetched_bytes if self._cache is not None else 0

    def take_fetched(self, shard: int) -> int:
        """The bytes of ``shard`` this process fetched and no open has counted yet (`take_copied`)."""
        return self._cache.take_copied(shard) if self._cache is not None else 0

    def is_cached(self, shard: int) -> bool | None:
        """Whether the node cache holds a verified copy of ``shard``; None without a cache."""
        return None if self._cache is None else self._cache.is_cached(shard)

    def being_fetched(self, shard: int) -> bool:
        """Someone (a warm, another rank's fetch-on-miss) holds the shard's fetch lock right now."""
        if self._cache is None:
            return False
        from ..cache.locks import held_exclusively

        return held_exclusively(self._cache.vdir.lock_path(shard))

    def map_shard(self, shard: int) -> MappedFile:
        """Memory-map one shard; with a cache, fetch it on a miss and pin it while mapped."""
        name = self.dataset.manifest.shards[shard].path
        if self._cache is None:
            mapped = MappedFile(self.dataset.shard_path(shard), name)
            try:
                self._verify(shard, mapped)
            except BaseException:
                mapped.close()
                raise
            return mapped
        stack = contextlib.ExitStack()
        try:
            path = self._cache.local_shard(shard)
            stack.enter_context(self._cache.reading(shard))
        except BaseException:
            stack.close()
            raise
        return MappedFile(path, name, release=stack.close)

    def _verify(self, shard: int, mapped: MappedFile) -> None:
        """A shard read in place gets the check the cache gives what it copies (loader/verify.py)."""
        verifier = self._verifier if self._verifier is not None else self._make_verifier()
        verifier.check(shard, mapped.buffer(), mapped.stat)

    def _make_verifier(self) -> InPlaceVerifier:
        from .verify import InPlaceVerifier

        self._verifier = InPlaceVerifier(self.dataset)
        return self._verifier
