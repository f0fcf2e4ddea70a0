"""Reading batches of global sample ids: positioned reads of the byte ranges in the index.

One `BatchReader` per process, opened lazily after fork, with the `loader.shardstore.ShardStore`
its source calls for: views of memory-mapped local shards (a local dataset or the node cache),
views of remote Arrow shards whose record batches are fetched by range, or remote tar samples
read by ranged requests. A batch of the default shape is assembled from the views with
vectorised numpy gathers; samples no view holds as plain arrays are decoded and collated.
Every error names the shard and the sample.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from ..format import FormatError
from ..format.coalesce import gap_from_env
from ..plan.ranges import locate_ids
from .cachefill import FILL_AHEAD
from .collate import KEY, Alloc, collate_samples, gather_field
from .observability.probe import NoProbe, Probe
from .scratch import Scratch
from .shardstore import ReadContext, ShardStore, open_store
from .source import Source, SourceSpec
from .tokenpieces import TokenPieces, TokenSources, join_pieces, pad_tokens

MAX_OPEN_SHARDS = 64


class BatchReader:
    def __init__(self, spec: SourceSpec, *, pad_id: int = 0, max_open_shards: int = MAX_OPEN_SHARDS):
        self.spec = spec
        self.pad_id = pad_id
        self._pid: int | None = None
        self._source: Source | None = None
        self._store: ShardStore | None = None
        self._scratch = Scratch()
        # Remote reads: neighbours within the coalescing gap are one request.
        self.ctx = ReadContext(gap=gap_from_env(), max_open=max_open_shards)

    @property
    def probe(self) -> Probe | NoProbe:
        """Counters and what is being read (loader/observability/probe.py); the observer sets it."""
        return self.ctx.probe

    @probe.setter
    def probe(self, probe: Probe | NoProbe) -> None:
        self.ctx.probe = probe

    # ------------------------------------------------------------------ per-process state
    @property
    def source(self) -> Source:
        # A forked worker must not share the parent's maps or remote sessions: reopen.
        if self._pid != os.getpid():
            parent = self._source.dataset if self._source is not None and self._source.cache is None else None
            self._source = source = self.spec.open(parent)
            self._pid = os.getpid()
            m = source.dataset.manifest
            self.offsets = m.shard_offsets()
            self.pad_field = m.length.get("field")
            self.tier = source.tier
            # The parent's views stay the parent's (a fork's copies are dropped, not closed).
            self._store = open_store(source, self.ctx)
            return source
        if self._source is None:
            raise RuntimeError("shardtool internal error: opened when _pid was set, above")
        return self._source

    @property
    def store(self) -> ShardStore:
        """Where this process reads shard bytes from (`loader.shardstore`), opened with the source."""
        self.source
        if self._store is None:
            raise RuntimeError("shardtool internal error: the store opens with the source, above")
        return self._store

    @property
    def by_view(self) -> bool:
        """Shards are read through views (all but remote tar ones, `loader.shardstore`)."""
        return self.store.by_view

    @property
    def fetches_ahead(self) -> bool:
        """`fetch_ahead` starts something: remote views' record batches, or the shards a node cache
        without a budget lacks (`loader.cachefill`)."""
        return self.store.fetches_ahead

    def ahead_depth(self, prefetch: int) -> int:
        """How many of a process's next batches to fetch ahead (`loader.readahead`): none where
        `fetch_ahead` starts nothing; ``prefetch`` for record batches held in memory until read;
        at least `FILL_AHEAD` for shards a node cache fills (on disk, so only time bounds it)."""
        if not self.store.fetches_ahead:
            return 0
        return max(prefetch, FILL_AHEAD) if self.store.fetches_to_disk else prefetch

    def fetch_ahead(self, ids: np.ndarray) -> None:
        """Start fetching what ``ids`` read that is neither here nor on its way (remote record
        batches, or shards the node cache lacks), every shard's at once, and return: reads wait
        for those fetches. Called with a batch as it is read, and the ones read next (`readahead`)."""
        if len(ids):
            self.store.fetch_ahead(*self.locate(ids))

    def handable(self, ids: np.ndarray) -> list[tuple[int, int, int]]:
        """(shard, sample, stored bytes) of the remote record batches ``ids`` read, one sample of
        each; none where this reader fetches none (`loader.remotefetch.hand_down`)."""
        return self.store.handable(*self.locate(ids)) if len(ids) else []

    def hand_down(self, shard: int, samples: list[int]) -> Future | None:
        """Start fetching record batches of ``shard`` (`handable`'s samples) for the workers forked next."""
        return self.store.hand_down(shard, samples)

    def inflate(self, ids: np.ndarray) -> list[int]:
        """Before a pass reading ``ids`` (its samples, in its order) forks its workers, in the rank's
        process: decompress into memory the compressed local shards it reads, as far as the budget
        allows, in a background thread while the pass reads (loader/inflate.py), or fetch the
        sample indexes of remote ones (`loader.indexahead`). Returns the shards it decompresses now."""
        if not len(ids):
            return []
        shards, first = np.unique(self.locate(ids)[0], return_index=True)
        # In the order the pass first reads them: the fill reaches the shards of batch b first.
        return self.store.before_pass(shards[np.argsort(first, kind="stable")].tolist())

    def read_indexes_early(self, shards: list[int]) -> None:
        """Start fetching the sample indexes of a remote dataset's ``shards`` (the rank's own) in
        the background: the pass's fetch before its workers fork finds them there."""
        self.store.read_indexes_early(shards)

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self.source  # (re)opened in a forked worker: its offsets
        return locate_ids(self.offsets, np.asarray(ids, dtype=np.int64))

    def where(self, gid: int) -> str:
        """'shard <path> sample #i' for a global id: for error messages."""
        shard, i = self.locate(np.array([gid]))
        return f"shard {self.source.dataset.manifest.shards[int(shard[0])].path} sample #{int(i[0])}"

    def close(self) -> None:
        if self._store is not None and self._pid == os.getpid():
            self._store.close()
        if self.ctx.inflated is not None:
            self.ctx.inflated.clear()

    # ------------------------------------------------------------------ reading
    def read_samples(self, ids: np.ndarray) -> list[dict[str, Any]]:
        """Decoded sample dicts (``__key__`` + every field), in the order of ``ids``."""
        return self.store.samples(*self.locate(ids))

    def field_values(self, ids: np.ndarray, names: tuple[str, ...]) -> dict[str, list[Any]]:
        """Fields ``names`` of ``ids``, decoded, in the order of ``ids`` (a packed batch's per-token
        fields, beside tokens it copies itself). Their bytes are counted with the tokens'."""
        ids = np.asarray(ids, dtype=np.int64)
        if not self.by_view:
            samples = self.read_samples(ids)
            return {f: [s[f] for s in samples] for f in names}
        groups = self.store.groups(*self.locate(ids))
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
        groups = self.store.groups(shard, local)
        fields = self.source.dataset.manifest.fields
        pad_col = groups[0][0].pad_col if groups else None
        if pad_col is not None and any(v.tok_dtype is None for v, _, _ in groups):
            self.probe.count_views(self.tier, groups)
            return self.collate(self.store.samples(shard, local, counted=True), ids, pad_id=self.pad_id, alloc=alloc)
        b = len(ids)
        keys = np.empty(b, dtype=object)
        for v, rows, li in groups:
            keys[rows] = v.keys[li]
        out: dict[str, Any] = {KEY: keys.tolist()}
        if pad_col is not None:
            tokens = self._gather_tokens(groups, b, alloc)  # counts the batch's bytes
            if tokens is None:
                self.probe.count_views(self.tier, groups)
                return self.collate(
                    self.store.samples(shard, local, counted=True), ids, pad_id=self.pad_id, alloc=alloc
                )
            out[fields[pad_col].name], out["lengths"] = tokens
        else:
            self.probe.count_views(self.tier, groups)
            out["lengths"] = torch.from_numpy(self.index_lengths(ids))  # Dataset.shard_index checked: = the index's
        for j, spec in enumerate(fields):
            if j == pad_col:
                continue
            out[spec.name] = gather_field(groups, j, b, pack, alloc)
        return out

    def token_sources(
        self,
        ids: np.ndarray,
        *,
        keys: bool = True,
        spans: tuple[np.ndarray, np.ndarray] | None = None,
        counted: bool = False,
    ) -> TokenSources | None:
        """Where the tokens of ``ids`` lie in the mapped shards, for callers that copy them
        themselves (packed batches). None when the length field is not a plain integer array
        (then `read_samples` decodes them), or for remote shards read sample by sample unless
        ``spans`` is given. ``keys=False``: an empty keys list (a lean packed batch carries none).
        ``spans``: (first element, elements) of the piece of each id the caller copies (a packed
        row's, eos included): what is counted as read, and all a remote tar shard fetches of it
        (`loader.tarpieces`: then each id's buffer holds only its piece, ``first`` = -start).
        ``counted``: the caller counts the bytes of mapped shards it copies (`count_pieces`)."""
        ids = np.asarray(ids, dtype=np.int64)
        if not self.by_view:
            return None if spans is None else self.store.piece_sources(*self.locate(ids), *spans, keys)
        groups = self.store.groups(*self.locate(ids))
        if not groups or groups[0][0].pad_col is None or any(v.tok_dtype is None for v, _, _ in groups):
            return None
        pieces = self._token_pieces(groups, spans, counted=counted)
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

    def count_pieces(self, elements: np.ndarray, dtype: np.dtype) -> None:
        """``elements`` of ``dtype`` copied from this reader's mapped shards, counted as read
        (remote ones count what they fetch)."""
        self.probe.queue_tokens(elements, 0, dtype.itemsize, self.tier)

    def _token_pieces(
        self, groups, spans: tuple[np.ndarray, np.ndarray] | None = None, *, counted: bool = False
    ) -> TokenPieces | None:
        """Every sample of ``groups``' tokens (`join_pieces`), counted unless ``counted`` says the
        caller does; None when some payload is not a plain array. ``spans`` (see `token_sources`):
        only the pieces' elements are counted (a long document's piece is a few hundred of its
        tokens, and the document is read again for each of its pieces)."""
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
        if counted:
            return joined
        item = groups[0][0].tok_dtype.itemsize
        if spans is not None:
            start, length = spans
            a = start[joined.rows]
            self.probe.queue_tokens(
                np.minimum(length[joined.rows], np.maximum(joined.counts - a, 0)), 0, item, self.tier
            )
        elif other is None:
            self.probe.count_views(self.tier, groups)
        else:  # queued, added up by the probe: no Python call per batch (Probe.flush)
            self.probe.queue_tokens(joined.counts, other, item, self.tier)
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
