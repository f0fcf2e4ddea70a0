"""Where one process reads shard bytes from: a `ShardStore`, chosen once when its source opens.

A store owns the process's views of shards (`loader.shardview.ShardView`) and every choice that
depends on where the bytes are, so that `loader.reader.BatchReader` assembles batches without
asking again on every call:

- `MappedStore`: local files (a dataset read in place, or the node cache). Each shard is
  memory-mapped, a compressed Arrow one decompressed into the rank's memory first where the budget
  allows (`loader.inflate`); at most ``max_open`` maps at once, the oldest closed first. Shards a
  node cache without a budget lacks are fetched ahead of their reads (`loader.cachefill`).
- `RangedArrowStore`: a remote Arrow dataset and no cache. Views hold no map: their record batches
  are fetched by ranged requests and kept decompressed (`loader.batchcache`), about once a pass.
- `RangedTarStore`: a remote tar dataset and no cache. No views: a batch's samples of one shard are
  read by ranged requests, neighbours within the coalescing gap as one (`shardtool.format.coalesce`).
  Read through views, a shuffled pass would fetch a shard's bytes about once per sample in it.
  A packed row's piece of a document is read as its slice of the tokens (`loader.tarpieces`).

The two remote stores fetch the rank's sample indexes before the workers fork (`loader.indexahead`).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..format import decode_sample
from .batchcache import fetch_pool, first_of_batches
from .cachefill import CacheFill
from .indexahead import IndexesAhead
from .inflate import Inflated, InflatedShard, inflate_budget
from .observability.probe import NO_PROBE, NoProbe, Probe
from .remotefetch import RemoteBatches, hand_down
from .shardview import ShardView
from .source import MappedFile, RemoteShard, Source
from .tarpieces import piece_sources
from .tokenpieces import TokenSources

__all__ = ["MappedStore", "RangedArrowStore", "RangedTarStore", "ReadContext", "ShardStore", "open_store"]

Groups = list[tuple[ShardView, np.ndarray, np.ndarray]]


@dataclass
class ReadContext:
    """What a reader's stores share, and what outlives a fork: the counters (the observer sets
    ``probe``), the lock of fetches on threads, what is being fetched ahead, and the compressed
    shards this rank decompressed into memory its workers inherit."""

    gap: int | None
    max_open: int
    probe: Probe | NoProbe = NO_PROBE
    lock: threading.Lock = field(default_factory=threading.Lock)
    fill: CacheFill = field(default_factory=CacheFill)
    indexes: IndexesAhead = field(default_factory=IndexesAhead)
    inflated: Inflated | None = None


class ShardStore:
    """Shards read through views, kept in `views` (least recently used first)."""

    by_view = True  # samples are read through views; otherwise `samples` decodes them one by one

    def __init__(self, source: Source, tar: bool, ctx: ReadContext):
        self.source, self.tar, self.ctx = source, tar, ctx
        self.views: OrderedDict[int, ShardView] = OrderedDict()

    @property
    def fetches_ahead(self) -> bool:
        """`fetch_ahead` starts something."""
        return False

    @property
    def fetches_to_disk(self) -> bool:
        """What `fetch_ahead` fetches lands in a node cache, not in this process's memory."""
        return False

    def _open(self, shard: int, index: Any) -> tuple[MappedFile | InflatedShard | RemoteShard, bool, Any]:
        """(the shard's bytes, whether they are compressed Arrow, its record-batch fetch or None)."""
        raise NotImplementedError

    def _bound(self) -> None:
        """Close what the store may not keep open."""

    def view(self, shard: int) -> ShardView:
        v = self.views.get(shard)
        if v is not None:
            self.views.move_to_end(shard)
            return v
        src, ds, probe = self.source, self.source.dataset, self.ctx.probe
        token = probe.opening(shard, src)
        index = ds.shard_index(shard)
        info = ds.manifest.shards[shard]
        mapped, compressed, fetch = self._open(shard, index)
        try:
            v = ShardView(
                mapped,
                index,
                ds.manifest.fields,
                tar=self.tar,
                pad_field=ds.manifest.length.get("field"),
                allow_pickle=ds.allow_pickle,
                compressed=compressed,
                plain_bytes=info.raw_bytes or info.bytes,
                fetch=fetch,
            )
        except BaseException:
            mapped.close()
            raise
        probe.opened(token, src)
        self.views[shard] = v
        self._bound()
        return v

    def groups(self, shard: np.ndarray, local: np.ndarray) -> Groups:
        """(view, rows of the batch, index in shard) per shard the batch touches."""
        order = np.argsort(shard, kind="stable")
        s_sorted = shard[order]
        cuts = np.flatnonzero(s_sorted[1:] != s_sorted[:-1]) + 1
        bounds = [0, *cuts.tolist(), len(order)]
        out = []
        for a, z in zip(bounds[:-1], bounds[1:]):
            if z > a:
                rows = order[a:z]
                out.append((self.view(int(s_sorted[a])), rows, local[rows]))
        return out

    def samples(self, shard: np.ndarray, local: np.ndarray, *, counted: bool = False) -> list[dict[str, Any]]:
        """Decoded sample dicts of (shard, index in shard) pairs, in their order; their bytes
        counted unless ``counted`` says the caller did."""
        if not counted:
            self.ctx.probe.count_views(self.source.tier, self.groups(shard, local))
        return [self.view(s).sample(i) for s, i in zip(shard.tolist(), local.tolist())]

    def piece_sources(
        self, shard: np.ndarray, local: np.ndarray, start: np.ndarray, length: np.ndarray, keys: bool
    ) -> TokenSources | None:
        """Where stores read no views: the tokens of the pieces (``start``, ``length``) of these
        samples, each read by itself (`loader.tarpieces`); None: decode whole samples."""
        return None

    def fetch_ahead(self, shard: np.ndarray, local: np.ndarray) -> None:
        """Start fetching what these samples read that is neither here nor on its way."""

    def handable(self, shard: np.ndarray, local: np.ndarray) -> list[tuple[int, int, int]]:
        """(shard, sample, stored bytes) of the remote record batches these samples read, one
        sample of each (`loader.remotefetch.hand_down`); none where the store fetches none."""
        return []

    def hand_down(self, shard: int, samples: list[int]) -> Future | None:
        """Start fetching those record batches of ``shard`` for the workers forked next."""
        return None

    def before_pass(self, shards: list[int]) -> list[int]:
        """Before a pass reading ``shards`` (in the order it first reads them) forks its workers;
        returns the shards it decompresses into memory now."""
        return []

    def read_indexes_early(self, shards: list[int]) -> None:
        """Start fetching the sample indexes of ``shards`` in the background, where they are remote."""

    def drop(self, shard: int) -> None:
        v = self.views.pop(shard, None)
        if v is not None:
            v.close()

    def close(self) -> None:
        for v in self.views.values():
            v.close()
        self.views.clear()


class MappedStore(ShardStore):
    @property
    def fetches_ahead(self) -> bool:
        return CacheFill.fills(self.source.cache)

    @property
    def fetches_to_disk(self) -> bool:
        return self.fetches_ahead

    def _open(self, shard: int, index: Any) -> tuple[MappedFile | InflatedShard | RemoteShard, bool, Any]:
        inflated = self.ctx.inflated
        plain = inflated.get(shard) if inflated is not None else None
        if plain is not None:
            return InflatedShard(plain, self.source.dataset.manifest.shards[shard].path), False, None
        return self.source.map_shard(shard), self.source.dataset.shard_compressed(shard), None

    def _bound(self) -> None:
        # The bound is on maps (address space, descriptors).
        while len(self.views) > self.ctx.max_open:
            _, old = self.views.popitem(last=False)
            old.close()

    def fetch_ahead(self, shard: np.ndarray, local: np.ndarray) -> None:
        cache = self.source.cache
        if CacheFill.fills(cache):
            self.ctx.fill.start(
                self.source.dataset, cache, [s for s in np.unique(shard).tolist() if s not in self.views]
            )

    def before_pass(self, shards: list[int]) -> list[int]:
        if self.tar or self.source.dataset.manifest.compression is None or not shards:
            return []
        if self.ctx.inflated is None:
            self.ctx.inflated = Inflated(inflate_budget(os.environ))
        return self.ctx.inflated.for_pass(self.source, shards, drop=self.drop)


class _Remote(ShardStore):
    def before_pass(self, shards: list[int]) -> list[int]:
        if shards:
            self.ctx.indexes.fetch(self.source.dataset, sorted(shards), self.tar)
        return []

    def read_indexes_early(self, shards: list[int]) -> None:
        self.ctx.indexes.start(self.source.dataset, shards, self.tar)


class RangedArrowStore(_Remote):
    @property
    def fetches_ahead(self) -> bool:
        return True

    def _open(self, shard: int, index: Any) -> tuple[MappedFile | InflatedShard | RemoteShard, bool, Any]:
        ds, ctx = self.source.dataset, self.ctx
        fetch = RemoteBatches(ds, shard, index, ctx.gap, ctx.probe, ctx.lock)
        return RemoteShard(ds.manifest.shards[shard].path), True, fetch

    # No bound: a view holds no map, only its index, and closing it would drop its decompressed
    # record batches: a share of more shards than the bound would fetch them again within a pass.

    def fetch_ahead(self, shard: np.ndarray, local: np.ndarray) -> None:
        for v, _, li in self.groups(shard, local):
            v.fetch_ahead(li)

    def handable(self, shard: np.ndarray, local: np.ndarray) -> list[tuple[int, int, int]]:
        ds, out = self.source.dataset, []
        for s in np.unique(shard).tolist():
            index = self.ctx.indexes.index(ds, s)  # the early fetch's, as soon as it is in
            batch = index.batch
            if index.checksums is None or batch is None:
                continue  # an older dataset: read through the shard's footer, not by range
            for i in np.unique(first_of_batches(batch)[batch[local[shard == s]]]).tolist():
                out.append((s, i, int(index.sizes[i])))
        return out

    def hand_down(self, shard: int, samples: list[int]) -> Future | None:
        ds, ctx = self.source.dataset, self.ctx
        return hand_down(ds, shard, samples, ctx.gap, ctx.probe.requests(shard, ctx.lock), fetch_pool())


class RangedTarStore(_Remote):
    by_view = False

    def __init__(self, source: Source, tar: bool, ctx: ReadContext):
        super().__init__(source, tar, ctx)
        self._seen: set[int] = set()  # shards read in this process: a shard's first read is its open

    def samples(self, shard: np.ndarray, local: np.ndarray, *, counted: bool = False) -> list[dict[str, Any]]:
        out: list[Any] = [None] * len(shard)
        order = np.lexsort((local, shard))
        for s in np.unique(shard).tolist():
            rows = order[shard[order] == s]
            for k, sample in zip(rows.tolist(), self._shard_samples(s, local[rows].tolist())):
                out[k] = sample
        return out

    @contextlib.contextmanager
    def _reading(self, s: int) -> Iterator[None]:
        """Around reads of shard ``s``: its first read in this process is announced as its open."""
        probe = self.ctx.probe
        first = s not in self._seen
        token = probe.opening(s, self.source) if first else None
        yield
        if first:
            self._seen.add(s)
            probe.opened(token, self.source)

    def piece_sources(
        self, shard: np.ndarray, local: np.ndarray, start: np.ndarray, length: np.ndarray, keys: bool
    ) -> TokenSources | None:
        ctx = self.ctx
        return piece_sources(
            self.source.dataset,
            shard,
            local,
            start,
            length,
            gap=ctx.gap,
            watch_of=lambda s: ctx.probe.requests(s, ctx.lock),
            opening=self._reading,
            keys=keys,
        )

    def _shard_samples(self, s: int, samples: list[int]) -> list[dict[str, Any]]:
        """Samples of shard ``s``, decoded; announced and counted (the bytes of the ranged reads,
        gaps included)."""
        ds, probe = self.source.dataset, self.ctx.probe
        with self._reading(s):
            raw = ds.raw_samples(s, samples, self.ctx.gap, probe.requests(s, self.ctx.lock))
        where = ds.manifest.shards[s].path
        return [
            decode_sample(ds.manifest, r, allow_pickle=ds.allow_pickle, where=f"{where} sample #{i}")
            for i, r in zip(samples, raw)
        ]


def open_store(source: Source, ctx: ReadContext) -> ShardStore:
    """The store of an opened source: mapped where its shards are local files, else by the form
    its manifest gives."""
    tar = source.dataset.manifest.shard_format == "tar"
    if source.local:
        return MappedStore(source, tar, ctx)
    return RangedTarStore(source, tar, ctx) if tar else RangedArrowStore(source, tar, ctx)
