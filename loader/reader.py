"""Reading batches of global sample ids: positioned reads of the byte ranges in the index.

One `BatchReader` per process, opened lazily after fork. Local shards (a local dataset or the
node cache) are memory-mapped once per process and kept in a small LRU; a batch of the
default shape is assembled with vectorised numpy gathers straight from the maps. Remote
shards (no cache) are read sample by sample through `Dataset.read`, one ranged request each,
except compressed Arrow ones: those are read through views too, whose record batches are fetched
by range and kept decompressed (loader/batchcache.py), each fetched about once per pass.
Every error names the shard and the sample.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from ..format import FormatError, decode_sample
from ..format.coalesce import gap_from_env
from ..plan.ranges import locate_ids
from .cachefill import CacheFill
from .collate import KEY, Alloc, collate_samples, gather_field
from .indexahead import IndexesAhead
from .inflate import Inflated, InflatedShard, inflate_budget
from .observability.probe import NO_PROBE, NoProbe, Probe
from .remotefetch import RemoteBatches
from .scratch import Scratch
from .shardview import ShardView
from .source import MappedFile, RemoteShard, Source, SourceSpec
from .tokenpieces import TokenPieces, TokenSources, join_pieces, pad_tokens

MAX_OPEN_SHARDS = 64


class BatchReader:
    def __init__(self, spec: SourceSpec, *, pad_id: int = 0, max_open_shards: int = MAX_OPEN_SHARDS):
        self.spec = spec
        self.pad_id = pad_id
        self.max_open = max_open_shards
        self._pid: int | None = None
        self._source: Source | None = None
        self._views: OrderedDict[int, ShardView] = OrderedDict()
        self._scratch = Scratch()
        # Counters and what is being read (loader/observability/probe.py); the observer sets it.
        self.probe: Probe | NoProbe = NO_PROBE
        self._remote_seen: set[int] = set()
        self._fetch_lock = threading.Lock()  # record batches of remote views are fetched on threads
        self._fill = CacheFill()  # shards being fetched into the node cache ahead of their reads
        self._indexes = IndexesAhead()  # a remote dataset's sample indexes, read before the fork
        # Compressed local shards decompressed by this rank's process into memory its workers
        # share (loader/inflate.py): the per-pid reset in `source` keeps it.
        self._inflated: Inflated | None = None
        self.coalesce_gap = gap_from_env()  # remote reads: neighbours within it are one request

    # ------------------------------------------------------------------ per-process state
    @property
    def source(self) -> Source:
        # A forked worker must not share the parent's maps or remote sessions: reopen.
        if self._pid != os.getpid():
            self._views = OrderedDict()
            self._remote_seen = set()
            parent = self._source.dataset if self._source is not None and self._source.cache is None else None
            self._source = source = self.spec.open(parent)
            self._pid = os.getpid()
            m = source.dataset.manifest
            self.offsets = m.shard_offsets()
            self.pad_field = m.length.get("field")
            self.tar = m.shard_format == "tar"
            self.tier = source.tier
            return source
        if self._source is None:
            raise RuntimeError("shardtool internal error: opened when _pid was set, above")
        return self._source

    @property
    def by_view(self) -> bool:
        """Shards are read through views: local ones, and Arrow ones wherever they are (remote
        ones keep the record batches they fetched, `loader.batchcache`: read sample by sample, a
        shuffled pass fetched a record batch about once per sample in it, ~10x the share)."""
        src = self.source
        return src.local or not self.tar

    def _view(self, shard: int) -> ShardView:
        v = self._views.get(shard)
        if v is not None:
            self._views.move_to_end(shard)
            return v
        src = self.source
        ds = src.dataset
        token = self.probe.opening(shard, src)
        index = ds.shard_index(shard)
        name = ds.manifest.shards[shard].path
        plain = self._inflated.get(shard) if self._inflated is not None else None
        # A remote Arrow shard's record batches are fetched and kept as a compressed one's are.
        compressed = plain is None and (ds.shard_compressed(shard) or not src.local)
        if plain is not None:
            mapped: MappedFile | InflatedShard | RemoteShard = InflatedShard(plain, name)
        else:
            mapped = src.map_shard(shard) if src.local else RemoteShard(name)
        try:
            v = ShardView(
                mapped,
                index,
                ds.manifest.fields,
                tar=self.tar,
                pad_field=self.pad_field,
                allow_pickle=ds.allow_pickle,
                compressed=compressed,
                plain_bytes=ds.manifest.shards[shard].raw_bytes or ds.manifest.shards[shard].bytes,
                fetch=None
                if src.local
                else RemoteBatches(ds, shard, index, self.coalesce_gap, self.probe, self._fetch_lock),
            )
        except BaseException:
            mapped.close()
            raise
        self.probe.opened(token, src)
        self._views[shard] = v
        # The bound is on maps (address space, descriptors). A remote view holds none, only its
        # index, and closing it would drop its decompressed record batches: a share of more
        # shards than the bound would then fetch its batches again and again within a pass.
        while src.local and len(self._views) > self.max_open:
            _, old = self._views.popitem(last=False)
            old.close()
        return v

    @property
    def fetches_views(self) -> bool:
        """Shards are read through views whose record batches are fetched from the store (remote
        Arrow shards, no node cache): what `fetch_ahead` starts."""
        src = self.source
        return not src.local and not self.tar

    @property
    def fetches_ahead(self) -> bool:
        """`fetch_ahead` starts something: remote views' record batches, or the shards a node cache
        without a budget lacks (`loader.cachefill`)."""
        return self.fetches_views or CacheFill.fills(self.source.cache)

    def fetch_ahead(self, ids: np.ndarray) -> None:
        """Start fetching what ``ids`` read that is neither here nor on its way (remote record
        batches, or shards the node cache lacks), every shard's at once, and return: reads wait
        for those fetches. Called with a batch as it is read, and the ones read next (`readahead`)."""
        if not len(ids):
            return
        if self.fetches_views:
            for v, _, li in self._groups(*self.locate(ids)):
                v.fetch_ahead(li)
        elif CacheFill.fills(cache := self.source.cache):
            shards = np.unique(self.locate(ids)[0]).tolist()
            self._fill.start(self.source.dataset, cache, [s for s in shards if s not in self._views])

    def inflate(self, ids: np.ndarray) -> list[int]:
        """Decompress into memory the compressed local shards that ``ids`` (a pass's samples, in
        its order) read, as far as the budget allows, in a background thread while the pass
        reads (loader/inflate.py); call it in the rank's process before workers fork. Returns
        the shards it decompresses now."""
        src = self.source
        if not src.local and len(ids):
            self._read_indexes_ahead(ids)
        if not src.local or self.tar or src.dataset.manifest.compression is None or not len(ids):
            return []
        if self._inflated is None:
            self._inflated = Inflated(inflate_budget(os.environ))
        shards, first = np.unique(self.locate(ids)[0], return_index=True)
        # In the order the pass first reads them: the fill reaches the shards of batch b first.
        return self._inflated.for_pass(src, shards[np.argsort(first, kind="stable")].tolist(), drop=self._drop_view)

    def _read_indexes_ahead(self, ids: np.ndarray) -> None:
        """The sample indexes of the remote shards ``ids`` read, and their record batches' schema,
        before the workers fork (`loader.indexahead`)."""
        self._indexes.fetch(self.source.dataset, np.unique(self.locate(ids)[0]).tolist(), self.tar)

    def read_indexes_early(self, shards: list[int]) -> None:
        """Start fetching the sample indexes of a remote dataset's ``shards`` (the rank's own) in
        the background: the pass's fetch before its workers fork finds them there."""
        src = self.source
        if not src.local:
            self._indexes.start(src.dataset, shards, self.tar)

    def _drop_view(self, shard: int) -> None:
        v = self._views.pop(shard, None)
        if v is not None:
            v.close()

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self.source  # (re)opened in a forked worker: its offsets
        return locate_ids(self.offsets, np.asarray(ids, dtype=np.int64))

    def where(self, gid: int) -> str:
        """'shard <path> sample #i' for a global id: for error messages."""
        shard, i = self.locate(np.array([gid]))
        return f"shard {self.source.dataset.manifest.shards[int(shard[0])].path} sample #{int(i[0])}"

    def close(self) -> None:
        for v in self._views.values():
            v.close()
        self._views.clear()
        if self._inflated is not None:
            self._inflated.clear()

    # ------------------------------------------------------------------ reading
    def read_samples(self, ids: np.ndarray) -> list[dict[str, Any]]:
        """Decoded sample dicts (``__key__`` + every field), in the order of ``ids``."""
        shard, local = self.locate(ids)
        if not self.by_view:
            # Remote tar shards: each shard's samples of the batch read together, neighbours
            # within the coalescing gap as one ranged request (`shardtool.format.coalesce`).
            ds = self.source.dataset
            out: list[Any] = [None] * len(ids)
            order = np.lexsort((local, shard))
            for s in np.unique(shard).tolist():
                rows = order[shard[order] == s]
                got = self._remote_samples(ds, s, local[rows].tolist())
                for k, sample in zip(rows.tolist(), got):
                    out[k] = sample
            return out
        self.probe.count_views(self.tier, self._groups(shard, local))
        return self._local_samples(shard, local)

    def _local_samples(self, shard: np.ndarray, local: np.ndarray) -> list[dict[str, Any]]:
        return [self._view(s).sample(i) for s, i in zip(shard.tolist(), local.tolist())]

    def _remote_samples(self, ds, s: int, samples: list[int]) -> list[dict[str, Any]]:
        """Samples of remote tar shard ``s``, decoded; with a probe announced and counted (the
        bytes of the ranged reads, gaps included): a shard's first read in this process is its open."""
        first = s not in self._remote_seen
        token = self.probe.opening(s, self.source) if first else None
        raw = ds.raw_samples(s, samples, self.coalesce_gap, self.probe.requests(s, self._fetch_lock))
        if first:
            self._remote_seen.add(s)
            self.probe.opened(token, self.source)
        where = ds.manifest.shards[s].path
        return [
            decode_sample(ds.manifest, r, allow_pickle=ds.allow_pickle, where=f"{where} sample #{i}")
            for i, r in zip(samples, raw)
        ]

    def field_values(self, ids: np.ndarray, names: tuple[str, ...]) -> dict[str, list[Any]]:
        """Fields ``names`` of ``ids``, decoded, in the order of ``ids`` (a packed batch's per-token
        fields, beside tokens it copies itself). Their bytes are counted with the tokens'."""
        ids = np.asarray(ids, dtype=np.int64)
        if not self.by_view:
            samples = self.read_samples(ids)
            return {f: [s[f] for s in samples] for f in names}
        groups = self._groups(*self.locate(ids))
        columns = [f.name for f in self.source.dataset.manifest.fields]
        out: dict[str, list[Any]] = {}
        for f in names:
            j = columns.index(f)
            col: list[Any] = [None] * len(ids)
            for v, rows, li in groups:
                for r, value in zip(rows.tolist(), v.values(j, li)):
                    col[r] = value
            out[f] = col
        return out

    def index_lengths(self, ids: np.ndarray) -> np.ndarray:
        """The lengths the sample indexes record for ``ids`` (the shards read anyway; never the
        dataset's whole lengths array)."""
        shard, local = self.locate(ids)
        out = np.empty(len(shard), dtype=np.int64)
        ds = self.source.dataset
        for s in np.unique(shard).tolist():
            mask = shard == s
            out[mask] = ds.shard_index(s).lengths[local[mask]]
        return out

    def collate(
        self, samples: list[Any], ids: np.ndarray, *, pad_id: int, alloc: Alloc | None = None
    ) -> dict[str, Any]:
        """The default collation of ``samples`` (those of ``ids``), lengths from the index."""
        return collate_samples(
            samples, pad_field=self.pad_field, pad_id=pad_id, lengths=self.index_lengths(ids), alloc=alloc or np.empty
        )

    def read_batch(self, ids: np.ndarray, *, pack: bool = False, alloc: Alloc | None = None) -> dict[str, Any]:
        """The default batch for ``ids``. ``alloc(shape, dtype)`` gives the arrays the batch's
        tensors are built in (in a worker: a shared-memory slot); ``pack``: large bytes fields
        as one `PackedBytes` (one copy into the slot instead of one pickle per sample)."""
        ids = np.asarray(ids, dtype=np.int64)
        alloc = alloc or np.empty
        if not self.by_view:
            return self.collate(self.read_samples(ids), ids, pad_id=self.pad_id, alloc=alloc)
        shard, local = self.locate(ids)
        groups = self._groups(shard, local)
        fields = self.source.dataset.manifest.fields
        pad_col = groups[0][0].pad_col if groups else None
        if pad_col is not None and any(v.tok_dtype is None for v, _, _ in groups):
            self.probe.count_views(self.tier, groups)
            return self.collate(self._local_samples(shard, local), ids, pad_id=self.pad_id, alloc=alloc)
        b = len(ids)
        keys = np.empty(b, dtype=object)
        for v, rows, li in groups:
            keys[rows] = v.keys[li]
        out: dict[str, Any] = {KEY: keys.tolist()}
        if pad_col is not None:
            tokens = self._gather_tokens(groups, b, alloc)  # counts the batch's bytes
            if tokens is None:
                self.probe.count_views(self.tier, groups)
                return self.collate(self._local_samples(shard, local), ids, pad_id=self.pad_id, alloc=alloc)
            out[fields[pad_col].name], out["lengths"] = tokens
        else:
            self.probe.count_views(self.tier, groups)
            out["lengths"] = torch.from_numpy(self.index_lengths(ids))  # Dataset.shard_index checked: = the index's
        for j, spec in enumerate(fields):
            if j == pad_col:
                continue
            out[spec.name] = gather_field(groups, j, b, pack, alloc)
        return out

    def _groups(self, shard: np.ndarray, local: np.ndarray) -> list[tuple[ShardView, np.ndarray, np.ndarray]]:
        """(view, rows of the batch, index in shard) per shard touched by the batch."""
        order = np.argsort(shard, kind="stable")
        s_sorted = shard[order]
        cuts = np.flatnonzero(s_sorted[1:] != s_sorted[:-1]) + 1
        bounds = [0, *cuts.tolist(), len(order)]
        out = []
        for a, z in zip(bounds[:-1], bounds[1:]):
            if z > a:
                rows = order[a:z]
                out.append((self._view(int(s_sorted[a])), rows, local[rows]))
        return out

    def token_sources(self, ids: np.ndarray, *, keys: bool = True) -> TokenSources | None:
        """Where the tokens of ``ids`` lie in the mapped shards, for callers that copy them
        themselves (packed batches). None for remote shards read sample by sample, or when the
        length field is not a plain integer array (then `read_samples` decodes them).
        ``keys=False``: an empty keys list (a lean packed batch carries none)."""
        ids = np.asarray(ids, dtype=np.int64)
        if not self.by_view:
            return None
        groups = self._groups(*self.locate(ids))
        if not groups or groups[0][0].pad_col is None or any(v.tok_dtype is None for v, _, _ in groups):
            return None
        pieces = self._token_pieces(groups)
        if pieces is None:
            return None
        which, first, counts = (np.empty(len(ids), np.int64) for _ in range(3))
        for out, values in zip((which, first, counts), (pieces.which, pieces.first, pieces.counts)):
            out[pieces.rows] = values
        names: list[Any] = []
        if keys:
            column = np.empty(len(ids), dtype=object)
            for v, r, li in groups:
                column[r] = v.keys[li]
            names = column.tolist()
        dtype = groups[0][0].tok_dtype
        if dtype is None:
            raise RuntimeError("shardtool internal error: no view's is None (checked above)")
        return TokenSources(names, pieces.buffers, which, first, counts, dtype)

    def _token_pieces(self, groups) -> TokenPieces | None:
        """Every sample of ``groups``' tokens (`join_pieces`), counted; None when some payload
        is not a plain array."""
        per_view = []
        other: int | None = 0  # bytes besides the tokens, where constant per sample (else None)
        for v, rows, li in groups:
            pieces = v.token_pieces(rows, li)  # a compressed shard's: its decompressed record batches
            if pieces is None:
                return None
            per_view.append(pieces)
            if other is not None:
                other = None if v.bytes_besides_tokens is None else other + len(li) * v.bytes_besides_tokens
        joined = join_pieces(per_view)
        if other is None:
            self.probe.count_views(self.tier, groups)
        else:  # queued, added up by the probe: no Python call per batch (Probe.flush)
            self.probe.queue_tokens(joined.counts, other, groups[0][0].tok_dtype.itemsize, self.tier)
        return joined

    def _gather_tokens(self, groups, b: int, alloc: Alloc) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Padded tokens and lengths, or None when some payload is not a plain array."""
        pieces = self._token_pieces(groups)
        if pieces is None:
            return None
        dtype = groups[0][0].tok_dtype if groups else np.dtype(np.int64)
        padded, counts = pad_tokens(pieces, b, dtype, self.pad_id, alloc, self._scratch)
        return torch.from_numpy(padded), torch.from_numpy(counts)


def describe_ids(reader: BatchReader, ids: np.ndarray, limit: int = 3) -> str:
    """Where a batch's samples live, for an error message."""
    try:
        shard, local = reader.locate(ids)
        m = reader.source.dataset.manifest
        names = sorted({m.shards[s].path for s in shard.tolist()})
        first = ", ".join(f"{m.shards[s].path}#{i}" for s, i in list(zip(shard.tolist(), local.tolist()))[:limit])
        more = f" and {len(names) - limit} more shards" if len(names) > limit else ""
        return f"samples {first}{'…' if len(ids) > limit else ''} (shards {', '.join(names[:limit])}{more})"
    except (FormatError, IndexError, ValueError):
        return f"{len(ids)} samples"
