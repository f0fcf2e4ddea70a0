"""Decompressed record batches of compressed Arrow shards read without a node cache.

A compressed shard's values are not in the file as they are read: each record batch is
decompressed when a read needs it and kept in a per-process cache sized to the open shards'
plain bytes (the rank's share), so a shuffled pass decompresses each batch about once per process.
A training batch's record batches that are not cached are decompressed on a few threads at once
(Arrow releases the GIL while it decompresses), each with its own reader of the shard.
A remote shard read without a node cache is the same, its batches fetched instead of sliced
from a map: each record batch's byte range is fetched (and checked against its index checksum) when
a read needs it, then kept decompressed here, so a shuffled pass fetches about the share's stored
bytes once per process, not a whole batch per sample.
(The node cache holds such shards plain, `cache.plain`: none of this runs for them.)
"""

from __future__ import annotations

import os
import warnings
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pyarrow as pa

from ..format import FieldSpec, FormatError
from ..format.arrowshard import check_schema
from ..format.decompress import ARROW_ERRORS, Decompressor
from ..format.sindex import as_numpy
from ..format.sizes import parse_size
from .remotefetch import RemoteBatches
from .tokenpieces import TokenPiece

PREFETCH_MIN = 8  # fewer missing batches than this are decompressed in the calling thread
THREADS = min(4, os.cpu_count() or 1)
_pool: tuple[int, ThreadPoolExecutor] | None = None  # (pid, pool): a forked worker makes its own
# Remote record batches are fetched, not decompressed: waiting on the store, not on a core. A
# training batch's missing ones are fetched this many at once (each a ranged request).
FETCH_THREADS = 16
_fetch_pool: tuple[int, ThreadPoolExecutor] | None = None
# Remote record batches whose fetch was started before a read needs them (`fetch_ahead`), by
# (view id, batch): what a read waits on instead of asking again. Per process, like the pool.
_pending: tuple[int, dict[tuple[int, int], Future]] | None = None


def pending_fetches() -> dict[tuple[int, int], Future]:
    """This process's fetches started ahead of their reads, by (view id, record batch)."""
    global _pending
    if _pending is None or _pending[0] != os.getpid():
        _pending = (os.getpid(), {})
    return _pending[1]


def fetch_pool() -> ThreadPoolExecutor:
    """This process's `FETCH_THREADS` threads for remote record batches."""
    global _fetch_pool
    if _fetch_pool is None or _fetch_pool[0] != os.getpid():
        _fetch_pool = (os.getpid(), ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="shardtool-fetch"))
    return _fetch_pool[1]


def decompress_pool() -> ThreadPoolExecutor | None:
    """This process's `THREADS` decompression threads; None on one core."""
    global _pool
    if THREADS < 2:
        return None
    if _pool is None or _pool[0] != os.getpid():
        _pool = (os.getpid(), ThreadPoolExecutor(THREADS, thread_name_prefix="shardtool-decompress"))
    return _pool[1]


def column_ranges(col, spec: FieldSpec, base: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    bufs = col.buffers()
    if spec.storage == "array":
        offs = as_numpy(col.offsets).astype(np.int64)  # not to_numpy: its first call imports pandas
        values = col.values
        item = np.dtype(spec.dtype).itemsize
        data = values.buffers()[1]
        addr = (data.address - base) if data is not None else 0
        return addr + (values.offset + offs[:-1]) * item, np.diff(offs) * item
    if spec.storage == "int":
        return (bufs[1].address - base) + (col.offset + np.arange(m, dtype=np.int64)) * 8, np.full(m, 8, np.int64)
    offs = np.frombuffer(bufs[1], dtype=np.int32)[col.offset : col.offset + m + 1].astype(np.int64)
    addr = (bufs[2].address - base) if bufs[2] is not None else 0
    return addr + offs[:-1], np.diff(offs)


def first_of_batches(batch: np.ndarray) -> np.ndarray:
    """Per record batch, its first sample: a remote record batch is asked for by one sample of it
    (every sample's range is its batch's), that one."""
    batches, first = np.unique(batch, return_index=True)
    out = np.zeros(int(batches.max(initial=-1)) + 1, np.int64)
    out[batches] = first
    return out


def decompressed_cache_cap(env) -> int:
    """The most a process keeps of decompressed record batches (reads of compressed shards without
    a node cache): ``SHARDTOOL_DECOMPRESSED_CACHE`` (a size, e.g. 8GiB), else 1/64 of the machine's
    memory: a node runs ranks x workers readers (8 x 2 of them would keep at most a quarter of it)."""
    text = env.get("SHARDTOOL_DECOMPRESSED_CACHE")
    if text:
        return parse_size(text, what="SHARDTOOL_DECOMPRESSED_CACHE", positive=True)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 64
    except (ValueError, OSError):
        return CompressedBatches.CACHE_BYTES


def _data_buffer(col, spec: FieldSpec):
    """The buffer holding a column's values, which `column_ranges` addresses are relative to."""
    if spec.storage == "array":
        return col.values.buffers()[1]
    return col.buffers()[1] if spec.storage == "int" else col.buffers()[2]


class CompressedBatches:
    """Samples of a compressed Arrow shard: each record batch decompressed when first needed and
    kept in a per-process cache of decompressed batches (`CACHE_BYTES` over every shard, least
    recently used evicted), so a shard read again and again is decompressed about once.

    Where the length field is an integer array (``tok_col``), decompressing a batch also records
    where each of its samples' tokens start in the batch's buffer and how many there are, per
    sample of the shard: those positions do not change when the batch is evicted and decompressed
    again, so `token_pieces` gathers a training batch with a few vectorised lookups and one cache
    lookup per distinct record batch, not numpy work per record batch.

    ``fetch`` (`loader.remotefetch.RemoteBatches`), where given, reads a remote shard's record
    batches by range, neighbours coalesced (``buf`` is then unused); else batches are decoded
    from ``buf``."""

    CACHE_BYTES = 256 << 20  # the least a process keeps
    _cap: int | None = None  # the most (decompressed_cache_cap), read once per process
    _share = 0  # plain bytes of the compressed shards this process has open: the rank's share
    _warned = False  # the share-exceeds-the-cache warning was given in this process
    decompressed = 0  # record batches this process decompressed (a pass over a share that fits: each once)
    _cache: OrderedDict = OrderedDict()  # (view id, batch) -> (fields' (bytes view, starts, sizes), bytes)
    _cached_bytes = 0
    _next_id = 0

    def __init__(
        self,
        buf,
        index,
        fields: list[FieldSpec],
        name: str,
        tok_col: int | None = None,
        plain_bytes: int = 0,
        fetch: RemoteBatches | None = None,
    ):
        self.fetch = fetch
        if fetch is not None:
            self._sample_of = first_of_batches(index.batch)
        else:
            # One thread a record batch: a record batch is small, and Arrow's pool spent more on handing
            # its columns out than on decompressing them (131 against 196 us a 64 KiB zstd batch).
            self._dec = Decompressor(buf, name)
            check_schema(self._dec.schema, fields, name)
        self.fields, self.name = fields, name
        self.batch, self.row = index.batch, index.row
        cls = CompressedBatches
        self.uid = cls._next_id
        cls._next_id += 1
        self._mine: set[int] = set()
        # Shuffled reads touch every batch of the rank's shards in every stretch of an epoch: a
        # cache smaller than their plain bytes decompresses most batches many times a pass.
        self.plain_bytes = plain_bytes
        cls._share += plain_bytes
        cls._warn_if_thrashing()
        self.tok_col = tok_col
        if tok_col is not None:
            self._item = np.dtype(fields[tok_col].dtype).itemsize
            n = len(index.batch)
            self._first = np.full(n, -1, np.int64)  # -1: its batch not decompressed yet
            self._count = np.zeros(n, np.int64)
            self._tok_ok = True  # False once a payload is not whole elements (then decoded per sample)
            self._by_batch = np.argsort(self.batch, kind="stable")
            self._batch_at = np.searchsorted(self.batch[self._by_batch], np.arange(int(self.batch.max(initial=-1)) + 2))

    def _decoded(self, b: int, rb: pa.RecordBatch | None = None) -> list:
        """Batch ``b``'s fields as (bytes view, starts, sizes); ``rb``: already decompressed."""
        cls = CompressedBatches
        key = (self.uid, b)
        hit = cls._cache.get(key)
        if hit is not None:
            cls._cache.move_to_end(key)
            return hit[0]
        if rb is None and self.fetch is not None and key in pending_fetches():
            self._collect([b])  # fetched ahead: wait for it rather than ask again
            hit = cls._cache.get(key)
            if hit is not None:
                return hit[0]
        if rb is None:
            rb = self._dec.batch(b) if self.fetch is None else self._fetched(b)
        got = []
        for j, spec in enumerate(self.fields):
            col = rb.column(j + 1)
            data = _data_buffer(col, spec)
            base = data.address if data is not None else 0
            starts, sizes = column_ranges(col, spec, base, rb.num_rows)
            # .data: memoryview(frombuffer(...)), which numpy's stubs allow only from Python 3.12
            view = np.frombuffer(data, np.uint8).data if data is not None else memoryview(b"")
            got.append((view, starts, sizes))
            if j == self.tok_col:
                self._note_tokens(b, starts, sizes)
        nbytes = rb.nbytes
        cls.decompressed += 1
        cls._cache[key] = (got, nbytes)
        cls._cached_bytes += nbytes
        self._mine.add(b)
        while cls._cached_bytes > cls.budget() and len(cls._cache) > 1:
            (uid, old), (_, n) = cls._cache.popitem(last=False)
            cls._cached_bytes -= n
        return got

    def fetch_ahead(self, li: np.ndarray) -> None:
        """Start fetching the record batches of samples ``li`` (a remote shard's) that are neither
        kept nor on their way, on the fetch pool, and return at once: a read of them waits for
        those fetches (`_collect`). Neighbours within the coalescing gap are one request."""
        if self.fetch is not None and len(li):
            self._start(np.unique(self.batch[li]).tolist())

    def _start(self, batches: list[int]) -> None:
        uid, cache, pending = self.uid, CompressedBatches._cache, pending_fetches()
        want = {int(self._sample_of[k]): k for k in batches if (uid, k) not in cache and (uid, k) not in pending}
        if not want or self.fetch is None:
            return
        pool = fetch_pool()
        for run in self.fetch.runs(sorted(want)):
            part = [want[i] for i in run]
            job = pool.submit(self._fetch_part, part)
            for k in part:
                pending[(uid, k)] = job

    def _collect(self, batches: list[int]) -> None:
        """Wait for the fetches of ``batches`` started ahead and keep what they brought (with the
        other batches of their requests); one that failed is left for `_decoded` to raise about."""
        pending, uid = pending_fetches(), self.uid
        jobs = {id(j): j for j in (pending.pop((uid, k), None) for k in batches) if j is not None}
        for job in jobs.values():
            for k, rb in job.result():
                pending.pop((uid, k), None)
                self._decoded(k, rb)

    def _prefetch(self, batches: list[int]) -> None:
        """Decompress the uncached ones of ``batches`` on the pool's threads, each with a reader of
        its own (one reader is not documented safe to share), and cache them; a batch that fails
        is left for `_decoded` to raise about. Remote ones are fetched (those not fetched ahead
        already) and waited for together."""
        missing = [k for k in batches if (self.uid, k) not in CompressedBatches._cache]
        if self.fetch is not None:  # remote: overlap the requests' waits
            self._start(missing)
            self._collect(missing)
            return
        pool = decompress_pool() if len(missing) >= PREFETCH_MIN else None
        if pool is None:
            return
        try:
            got = self._dec.batches(missing, pool, THREADS)
        except FormatError:
            return
        for k, rb in zip(missing, got):
            self._decoded(k, rb)

    def _fetched(self, b: int) -> pa.RecordBatch:
        """Record batch ``b`` of a remote shard, fetched by its range (`loader.remotefetch`)."""
        return self._fetch([b])[0]  # decoded by `shardtool.format.decompress.range_batch`

    def _fetch_part(self, batches: list[int]) -> list[tuple[int, pa.RecordBatch]]:
        """Record batches ``batches`` of a remote shard, fetched ahead; none where one fails (the
        read of it asks again, and raises)."""
        try:
            return list(zip(batches, self._fetch(batches)))
        except (FormatError, *ARROW_ERRORS):
            return []

    def _fetch(self, batches: list[int]) -> list[pa.RecordBatch]:
        fetch = self.fetch
        if fetch is None:
            raise RuntimeError("shardtool internal error: only a remote shard's record batches are fetched")
        return fetch([int(self._sample_of[k]) for k in batches])

    def _note_tokens(self, b: int, starts: np.ndarray, sizes: np.ndarray) -> None:
        """Token positions of batch ``b``'s samples (element offsets into its values buffer)."""
        samples = self._by_batch[self._batch_at[b] : self._batch_at[b + 1]]
        if not len(samples) or self._first[samples[0]] >= 0:
            return  # decompressed before, then evicted: the positions are the same
        item = self._item
        if (starts % item).any() or (sizes % item).any():
            self._tok_ok = False
            return
        rows = self.row[samples].astype(np.int64)
        self._first[samples] = starts[rows] // item
        self._count[samples] = sizes[rows] // item

    def token_pieces(self, rows: np.ndarray, li: np.ndarray) -> list[TokenPiece] | None:
        """`ShardView.token_pieces`: (rows, first, count, which, buffers), ``which`` indexing
        ``buffers`` (the length field's values of each distinct record batch of ``li``)."""
        ub, which = np.unique(self.batch[li], return_inverse=True)
        j, uid, cache = self.tok_col, self.uid, CompressedBatches._cache
        if j is None:
            raise RuntimeError(
                "shardtool internal error: ShardView asks only where the length field is an int array: tok_col given"
            )
        # One lookup per record batch, inline (this runs for every shard of every training
        # batch); hits become the most recent first, so decompressing the misses evicts others.
        keys = ub.tolist()
        hits = [cache.get((uid, k)) for k in keys]
        missing = []
        for k, hit in zip(keys, hits):
            if hit is None:
                missing.append(k)
            else:
                cache.move_to_end((uid, k))
        if missing:
            self._prefetch(missing)
        bufs = [(hit[0] if hit is not None else self._decoded(k))[j][0] for k, hit in zip(keys, hits)]
        if not self._tok_ok:
            return None
        return [TokenPiece(rows, self._first[li], self._count[li], which.reshape(-1), bufs)]

    def field_bytes(self, i: int, j: int) -> bytes:
        # Called once per sample and field: scalar reads by .item(), and a bare cache lookup (a
        # training batch's record batches were just touched by `token_pieces` or by its earlier
        # samples), not `_decoded`'s LRU bookkeeping.
        b = self.batch.item(i)
        hit = CompressedBatches._cache.get((self.uid, b))
        view, starts, sizes = (hit[0] if hit is not None else self._decoded(b))[j]
        r = self.row.item(i)
        a = starts.item(r)
        return bytes(view[a : a + sizes.item(r)])

    def fields_bytes(self, li: np.ndarray, j: int) -> list[bytes]:
        """`field_bytes` of samples ``li`` (a shard's samples of one training batch), one cache
        lookup per run of samples of one record batch."""
        cache, uid = CompressedBatches._cache, self.uid
        out = []
        last = -1
        for b, r in zip(self.batch[li].tolist(), self.row[li].tolist()):
            if b != last:
                hit = cache.get((uid, b))
                view, starts, sizes = (hit[0] if hit is not None else self._decoded(b))[j]
                last = b
            a = starts.item(r)
            out.append(bytes(view[a : a + sizes.item(r)]))
        return out

    @classmethod
    def _warn_if_thrashing(cls) -> None:
        """Once a process: its share does not fit the decompressed batches it may keep. Shuffled
        reads then find most record batches evicted and decompress them again, sample after
        sample (measured: 1/75 of a plain read on a share 3x the cache, 64 KiB batches; 1 MiB
        ones cost 3x more)."""
        if cls._warned or cls._share <= cls.budget():
            return
        cls._warned = True
        warnings.warn(
            f"compressed shards read without a node cache: this process's share "
            f"({cls._share / 1e9:.2f} GB decompressed) exceeds the decompressed record batches it keeps "
            f"({cls.budget() / 1e9:.2f} GB; SHARDTOOL_DECOMPRESSED_CACHE), so most batches will be "
            "decompressed many times a pass; give the loader a cache_dir (shards are decompressed "
            "into it once), or raise SHARDTOOL_DECOMPRESSED_SHARE (the shards a rank holds "
            "decompressed in memory) or SHARDTOOL_DECOMPRESSED_CACHE",
            RuntimeWarning,
            stacklevel=2,
        )

    @classmethod
    def budget(cls) -> int:
        """Bytes of decompressed batches kept: the open shards' plain bytes, at least CACHE_BYTES,
        at most `decompressed_cache_cap`."""
        if cls._cap is None:
            cls._cap = decompressed_cache_cap(os.environ)
        return max(cls.CACHE_BYTES, min(cls._share + (cls._share >> 4), cls._cap))

    def close(self) -> None:
        cls = CompressedBatches
        cls._share -= self.plain_bytes
        self.plain_bytes = 0
        for b in self._mine:
            hit = cls._cache.pop((self.uid, b), None)
            if hit is not None:
                cls._cached_bytes -= hit[1]
        self._mine.clear()
        pending = pending_fetches()
        for key in [key for key in pending if key[0] == self.uid]:
            del pending[key]  # fetched ahead for a pass that ended first: dropped unread
