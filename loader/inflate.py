"""Compressed Arrow shards read without a node cache, decompressed once into the rank's memory.

A shuffled pass touches every record batch of a rank's share in every stretch of the pass, so a
reader that decompresses record batches as samples need them (`loader.batchcache`) does it once
per pass per process at best, and gathers each training batch from a hundred separate batch
buffers. Before a pass's workers fork, the rank's process therefore decompresses the compressed
shards the pass reads into plain Arrow IPC files in memory, as the node cache does on disk
(`cache.plain`), up to a budget. The workers inherit them by fork: pages nobody writes stay
shared, so a rank holds one copy, not one a worker, and reads them exactly as it reads a plain
shard's map. Later passes reuse them: a rank decompresses its share once per run (ranges are
sticky, DESIGN §2), not once per pass and worker. Shards past the budget are read through
`loader.batchcache`. Which shards to hold is `choose`, a pure function of the pass's shards.

Only local shards are decompressed here (read in place, or a ``warm --keep-compressed`` cache):
a remote share would be a whole download before the first batch (batchcache fetches by range).
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from collections.abc import Callable, Mapping, Sequence

import pyarrow as pa

from ..format import FormatError
from ..format.arrowshard import write_plain
from ..format.sizes import parse_size
from .batchcache import decompress_pool
from .source import MappedFile, Source

ENV = "SHARDTOOL_DECOMPRESSED_SHARE"
LOG_BYTES = 1 << 30  # a pass's decompression is announced before it starts from this size
log = logging.getLogger(__name__)


def inflate_budget(env: Mapping[str, str]) -> int:
    """Plain bytes of compressed shards one rank keeps decompressed in memory: ``ENV`` (a size,
    e.g. 8GiB; 0 turns it off), else a quarter of the machine's memory over its ranks
    (``LOCAL_WORLD_SIZE``, as torchrun sets it)."""
    text = env.get(ENV)
    if text:
        return int(parse_size(text, what=ENV) or 0)
    try:
        ranks = max(1, int(env.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        ranks = 1
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (4 * ranks)
    except (ValueError, OSError):
        return 0


def choose(want: Sequence[int], held: Mapping[int, int], sizes: Mapping[int, int], budget: int) -> list[int]:
    """The shards to hold decompressed for a pass reading ``want`` (in that order of priority):
    those of ``want`` already held, then the others in order while their plain ``sizes`` fit the
    budget. Shards held but not wanted are dropped (the caller frees them)."""
    keep = [s for s in want if s in held]
    total = sum(held[s] for s in keep)
    out = set(keep)
    for s in want:
        if s not in out and total + sizes[s] <= budget:
            out.add(s)
            total += sizes[s]
    return [s for s in want if s in out]


class InflatedShard:
    """A shard's plain form in memory, in place of a `MappedFile` (the memory is `Inflated`'s)."""

    def __init__(self, mm: mmap.mmap, shard_name: str):
        self._mm: mmap.mmap | None = mm
        self.size = len(mm)
        self.shard_name = shard_name

    def buffer(self):
        return self._mm if self._mm is not None else b""

    def close(self) -> None:
        self._mm = None


def decompress(data, name: str, plain_bytes: int) -> mmap.mmap:
    """The plain Arrow IPC file of the compressed shard ``data`` (a verified map) in anonymous
    memory: an mmap, so that it reads (slices to bytes, buffer addresses) exactly as a shard's
    map does. Written straight into memory of the size the manifest records for it, then cut to
    what was written; a shard larger than recorded (an older manifest) is written again, growing."""
    try:
        if plain_bytes > 0:
            # Populated at once (zeroed pages in one call, not a fault a page as Arrow writes:
            # 16% of a shard's time in memory here). Private: a fork shares the pages, copying none.
            populate = getattr(mmap, "MAP_POPULATE", 0)
            mm = mmap.mmap(-1, plain_bytes + (64 << 10), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
            n = _write_into(mm, data)
            if n is not None:
                return _cut(mm, n)
            _close(mm)
        stream = pa.BufferOutputStream()
        write_plain(pa.py_buffer(data), stream)
        out = stream.getvalue()
        mm = mmap.mmap(-1, max(out.size, 1))
        mm[: out.size] = memoryview(out)
        return _cut(mm, out.size)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise FormatError(f"shard {name}: verified but cannot be decompressed ({e})") from None


def _write_into(mm: mmap.mmap, data) -> int | None:
    """Bytes written of ``data``'s plain form into ``mm``; None where it does not fit. Returns
    only once the writer is gone, so that ``mm`` has no exports left (resize and close need that)."""
    sink = pa.FixedSizeBufferWriter(pa.py_buffer(mm))
    try:
        write_plain(pa.py_buffer(data), sink)
    except OSError:  # "Write out of bounds": larger than the manifest says
        return None
    return sink.tell()


def _cut(mm: mmap.mmap, n: int) -> mmap.mmap:
    """``mm`` cut to its first ``n`` bytes: an Arrow file is read from its end (its footer)."""
    if n == len(mm):
        return mm
    try:
        mm.resize(n)  # mremap where the platform has it
        return mm
    except (OSError, SystemError, ValueError):
        exact = mmap.mmap(-1, n)
        exact[:n] = mm[:n]
        mm.close()
        return exact


class Inflated:
    """The shards one rank holds decompressed: {shard: plain IPC file bytes}."""

    def __init__(self, budget: int):
        self.budget = budget
        self.copies: dict[int, mmap.mmap] = {}
        self.loaded = 0  # shards decompressed so far (each once a run while the share fits)

    def get(self, shard: int) -> mmap.mmap | None:
        return self.copies.get(shard)

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.copies.values())

    def for_pass(self, src: Source, shards: Sequence[int], drop: Callable[[int], None]) -> list[int]:
        """`fill` for a pass of local ``src`` reading ``shards``: its compressed ones, and in a node
        cache (``warm --keep-compressed``) only those already there: the others are fetched on a
        miss as reads reach them (or by the in-job stager), not all before the first batch.
        Says what it did."""
        ds = src.dataset
        want = [s for s in shards if ds.shard_compressed(s) and src.is_cached(s) is not False]
        infos = ds.manifest.shards
        # A manifest without the plain size (older packs) is guessed at 4x: zstd on token ids
        # is ~1.6x, on text 3-5x; a short guess only costs a growing buffer (`decompress`).
        sizes = {s: int(infos[s].raw_bytes or 4 * infos[s].bytes) for s in want}
        began = time.perf_counter()
        done = self.fill(want, sizes, src.map_shard, pool=decompress_pool(), drop=drop)
        if done:
            log.info(
                "decompressed %d compressed shards of this rank's pass into memory in %.2f s (%.2f GB held "
                "of %.2f GB allowed, %s; %d of %d shards held)",
                len(done),
                time.perf_counter() - began,
                self.nbytes / 1e9,
                self.budget / 1e9,
                ENV,
                len(self.copies),
                len(want),
            )
        return done

    def clear(self) -> None:
        """Frees every shard held (their views closed first)."""
        for mm in self.copies.values():
            _close(mm)
        self.copies.clear()

    def _held(self) -> dict[int, int]:
        return {s: len(b) for s, b in self.copies.items()}

    def fill(
        self,
        want: Sequence[int],
        sizes: Mapping[int, int],
        open_shard: Callable[[int], MappedFile],
        pool=None,
        drop: Callable[[int], None] | None = None,
    ) -> list[int]:
        """Hold what `choose` picks for ``want``: drops the others (``drop(shard)`` first, for
        the caller's views over them), then opens the missing ones (``open_shard``: a verified
        map, in this thread) and decompresses them, on ``pool``'s threads where given (Arrow
        decompresses without the GIL), announced first where that takes seconds. Returns the
        shards decompressed."""
        chosen = choose(want, self._held(), sizes, self.budget)
        for s in [s for s in self.copies if s not in set(chosen)]:
            if drop is not None:
                drop(s)
            _close(self.copies.pop(s))
        missing = [s for s in chosen if s not in self.copies]
        todo = sum(sizes[s] for s in missing)
        if todo >= LOG_BYTES:  # said before a wait of seconds, not only after it
            log.info("decompressing %.1f GB of compressed shards into memory before the first batch", todo / 1e9)
        opened: list[MappedFile] = []
        try:
            for s in missing:
                opened.append(open_shard(s))

            def one(k: int) -> mmap.mmap:
                return decompress(opened[k].buffer(), opened[k].shard_name, sizes[missing[k]])

            ks = range(len(missing))
            for s, buf in zip(missing, pool.map(one, ks) if pool is not None and len(missing) > 1 else map(one, ks)):
                self.copies[s] = buf
                self.loaded += 1
        finally:
            for m in opened:
                m.close()
        return missing


def _close(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:
        pass  # a view handed out still points into it: freed when that view is collected
