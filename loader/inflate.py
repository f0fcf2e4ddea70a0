"""Compressed Arrow shards read without a node cache, decompressed once into the rank's memory.

A shuffled pass touches every record batch of a rank's share in every stretch of the pass, so a
reader that decompresses record batches as samples need them (`loader.batchcache`) does it once
per pass per process at best, and gathers each training batch from a hundred separate batch
buffers. The rank's process therefore decompresses the compressed shards the pass reads into
plain Arrow IPC files in memory, as the node cache does on disk (`cache.plain`), up to a budget,
and readers read them exactly as a plain shard's map. Later passes reuse them: a rank
decompresses its share once per run (ranges are sticky, docs/architecture.md §2.3), not once per pass and worker.
Shards past the budget are read through `loader.batchcache`. Which shards to hold is `choose`, a
pure function of the pass's shards in the order it first reads them.

The pass does not wait for the whole share: before its workers fork, the rank's process maps the
memory of every shard it will decompress, shared (`loader.inflatefill`), and a background thread
fills it, shard after shard in the order the pass first reads them, each on the decompression
pool's threads. A reader (the trainer with ``num_workers=0``, or a forked worker) that opens a
shard waits for that shard only, on a board in shared memory; one the thread could not hold
(damaged, larger than its manifest says, the loader closing) is read the ordinary way, which
verifies it and names it in any error. A shard held from an earlier pass is inherited by fork as
before: one copy a rank, whatever the workers.

Only local shards are decompressed here (read in place, or a ``warm --keep-compressed`` cache):
a remote share would be a whole download before the first batch (batchcache fetches by range).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from ..format.sizes import parse_size
from .batchcache import decompress_pool
from .inflatefill import (
    ABSENT,
    PENDING,
    SLACK,
    Arena,
    ForkGate,
    Stopped,
    close_map,
    decompress,
    free,
    write_shared,
)
from .source import MappedFile, Source

__all__ = ["ENV", "Inflated", "InflatedShard", "choose", "decompress", "inflate_budget"]

ENV = "SHARDTOOL_DECOMPRESSED_SHARE"
LOG_BYTES = 1 << 30  # a pass's decompression is announced when it starts from this size
MAGIC = b"ARROW1"  # an Arrow IPC file ends with it (after its footer)
MAGIC_BYTES = 2 * 8 + 4  # no Arrow IPC file is shorter: magic, padding, footer length, magic
POLL_S = (1e-4, 2e-3)  # a reader waiting for its shard looks at the board this often (first, at most)
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

    def buffer(self) -> mmap.mmap | bytes:
        return self._mm if self._mm is not None else b""

    def close(self) -> None:
        self._mm = None


class Inflated:
    """The shards one rank holds decompressed, {shard: plain IPC file in memory}, and the fill of
    those a pass still needs. `for_pass` runs in the rank's process before its workers fork;
    `get` in whichever process reads."""

    def __init__(self, budget: int):
        self.budget = budget
        self.copies: dict[int, mmap.mmap] = {}  # ready (in a forked worker: those it mapped)
        self.loaded = 0  # shards decompressed so far (each once a run while the share fits)
        self.waited = 0  # shards this process's readers waited for (their fill had not reached them)
        self._refused = 0  # ready flags not believed on the boards of passes ended (`refused`)
        self._last_refused: tuple[int, int] | None = None
        # Tests hold the fill back with it: ``pace(k, stop)`` runs before the fill's k-th shard.
        self.pace: Callable[[int, threading.Event], None] | None = None
        self._owner = os.getpid()
        self._arena: Arena | None = None  # the shards being filled: shared memory, made before the fork
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._regrown: set[int] = set()  # held privately after the fork (larger than recorded)
        self._gate = ForkGate()

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.copies.values())

    @property
    def refused(self) -> int:
        """Ready flags some reader of this rank did not believe (`_refuse`), workers included:
        a defect, never expected (`last_refused` says which)."""
        arena = self._arena
        return self._refused + (arena.refused[0] if arena is not None else 0)

    @property
    def last_refused(self) -> tuple[int, int] | None:
        """(shard, the value its flag read) of the last ready flag not believed, where known."""
        arena = self._arena
        if arena is not None and arena.refused[0]:
            return arena.refused[1:]
        return self._last_refused

    @property
    def filling(self) -> bool:
        """The background fill is still running (in the rank's process)."""
        return self._thread is not None and self._thread.is_alive()

    def get(self, shard: int) -> mmap.mmap | None:
        """The plain file of ``shard``, waiting while the fill has yet to write it; None where it is
        not held (read it record batch by record batch, or the ordinary way)."""
        mm = self.copies.get(shard)
        if mm is not None:
            return mm
        arena = self._arena
        if arena is None or shard not in arena.slot:
            return None
        n = arena.get(shard)
        if n == PENDING:
            self.waited += 1
            n = self._wait(arena, shard)
        mm = self.copies.get(shard)  # the rank's process maps it before it flags it
        if mm is None and n >= 0:
            if not MAGIC_BYTES <= n <= arena.size[shard]:
                self._refuse(arena, shard, n, "a length no Arrow file of its region has")
                return None
            mm = arena.view(shard, n)  # a forked worker maps it now
            if mm[-len(MAGIC) :] != MAGIC:
                close_map(mm)
                self._refuse(arena, shard, n, "no Arrow footer at the end of what it flags ready")
                return None
            self.copies[shard] = mm
        return mm

    def _refuse(self, arena: Arena, shard: int, n: int, why: str) -> None:
        """A ready flag this process cannot believe: the shard is read the ordinary way (which
        verifies it); counted on the board, where the rank's process sees it (`refused`), and
        logged with the state, to find how it came about."""
        arena.refuse(shard, n)
        log.warning(
            "shard %d: the background decompression flags it ready at %d bytes, %s (pid %d, rank's "
            "process %d, alive %s; held here %s): reading it the ordinary way",
            shard,
            n,
            why,
            os.getpid(),
            self._owner,
            os.getppid() == self._owner or os.getpid() == self._owner,
            sorted(self.copies),
        )
        return None

    def _wait(self, arena: Arena, shard: int) -> int:
        delay = POLL_S[0]
        while True:
            n = arena.get(shard)
            if n != PENDING:
                return n
            if os.getpid() == self._owner:
                if not self.filling:
                    n = arena.get(shard)
                    return ABSENT if n == PENDING else n
            elif os.getppid() != self._owner:
                return ABSENT  # the rank's process is gone: read it the ordinary way
            time.sleep(delay)
            delay = min(2 * delay, POLL_S[1])

    def for_pass(self, src: Source, shards: Sequence[int], drop: Callable[[int], None]) -> list[int]:
        """Before a pass of local ``src`` reading ``shards`` (in the order it first reads them)
        forks its workers: what `choose` holds of its compressed ones, and in a node cache
        (``warm --keep-compressed``) only those already there (the others are fetched on a miss
        as reads reach them, or by the in-job stager, not all before the first batch). Frees what
        is no longer chosen (``drop(shard)`` first, for the caller's views over it), maps shared
        memory for the chosen shards not yet held and starts their fill. Returns those shards."""
        self._halt()
        ds = src.dataset
        want = [s for s in shards if ds.shard_compressed(s) and src.is_cached(s) is not False]
        infos = ds.manifest.shards
        # A manifest without the plain size (older packs) is guessed at 4x: zstd on token ids
        # is ~1.6x, on text 3-5x; a short guess only costs a private copy (`decompress`).
        sizes = {s: int(infos[s].raw_bytes or 4 * infos[s].bytes) for s in want}
        chosen = choose(want, {s: len(b) for s, b in self.copies.items()}, sizes, self.budget)
        keep = set(chosen)
        for s in [s for s in self.copies if s not in keep]:
            drop(s)
            free(self.copies.pop(s))  # the previous pass's workers are gone
        for s in self._regrown:
            drop(s)  # read record batch by record batch last pass: the plain copy from now on
        self._regrown = set()
        missing = [s for s in chosen if s not in self.copies]
        if not missing:
            return []
        for s in missing:
            drop(s)
        todo = sum(sizes[s] for s in missing)
        if todo >= LOG_BYTES:
            log.info("decompressing %.1f GB of compressed shards into memory while the pass reads", todo / 1e9)
        self._arena = Arena({s: sizes[s] + SLACK for s in missing})
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._fill,
            args=(missing, src.map_shard, self._arena, self._stop),
            name="shardtool-inflate",
            daemon=True,  # an interpreter that exits mid-pass does not wait for it
        )
        self._thread.start()
        return missing

    def _fill(
        self,
        order: list[int],
        open_shard: Callable[[int], MappedFile],
        arena: Arena,
        stop: threading.Event,
    ) -> None:
        """The background fill: each shard of ``order`` opened (a verified map) and written plain
        into its region of ``arena``, then flagged ready. A shard it cannot hold is flagged
        `ABSENT`, and so is every one left when it ends, however it ends."""
        began = time.perf_counter()
        pool = decompress_pool()
        done = 0
        try:
            for k, s in enumerate(order):
                if self.pace is not None:
                    self.pace(k, stop)
                if stop.is_set():
                    break
                done += self._one(s, open_shard, arena, pool, stop)
        except Stopped:
            pass
        except Exception:  # never the pass's end: its readers read the rest the ordinary way
            log.exception("the background decompression of compressed shards failed")
        finally:
            for s in order:
                if arena.get(s) == PENDING:
                    arena.set(s, ABSENT)
            if done:
                log.info(
                    "decompressed %d compressed shards of this rank's pass into memory in %.2f s, while it "
                    "read (%.2f GB held of %.2f GB allowed, %s; %d shards held)",
                    done,
                    time.perf_counter() - began,
                    self.nbytes / 1e9,
                    self.budget / 1e9,
                    ENV,
                    len(self.copies),
                )

    def _one(self, s: int, open_shard, arena: Arena, pool, stop: threading.Event) -> bool:
        """Shard ``s`` filled and flagged; False where it is flagged `ABSENT` instead."""
        try:
            mapped = open_shard(s)
        except Exception as e:  # damaged, unreadable: the reader's own open says so, naming it
            log.warning("shard %d is read record batch by record batch: %s", s, e)
            arena.set(s, ABSENT)
            return False
        region = arena.region(s)
        kept = False
        try:
            with self._gate:
                n = write_shared(region, mapped.buffer(), mapped.shard_name, pool, stop, self._gate)
                if n is None:  # larger than its manifest says: the workers of this pass cannot see more
                    arena.set(s, ABSENT)
                    self.copies[s] = decompress(mapped.buffer(), mapped.shard_name, 0)
                    self._regrown.add(s)
                else:
                    self.copies[s] = arena.view(s, n)
                    kept = True
                    arena.set(s, n)
            self.loaded += 1
            return True
        except Stopped:
            raise
        except Exception as e:
            log.warning("shard %d is read record batch by record batch: %s", s, e)
            arena.set(s, ABSENT)
            return False
        finally:
            mapped.close()
            if kept:
                close_map(region)
            else:
                free(region)  # what was written of it: no reader has seen its flag

    def _halt(self) -> None:
        """Stops a fill still running (the thread ends within a record batch) and closes its arena
        (the views of the shards it filled keep their memory; the readers that watched its board
        are gone with their pass)."""
        if os.getpid() != self._owner:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._arena is not None:
            count, shard, value = self._arena.refused
            if count:
                self._refused += count
                self._last_refused = (shard, value)
            self._arena.close()
            self._arena = None

    def clear(self) -> None:
        """Stops the fill and frees every shard held (their views closed first)."""
        self._halt()
        for mm in self.copies.values():
            close_map(mm)
        self.copies.clear()
