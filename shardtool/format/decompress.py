"""The one way a compressed Arrow shard is decompressed: record batch by record batch, a reader per thread.

Three readers need a compressed shard's (``pack --compression``) values plain, and all of them go
through `Decompressor`:

- the node cache rewrites the shard plain on disk once, on the way in (`cache.plain`);
- a rank without a cache rewrites its share plain into memory, once a run (`loader.inflate`);
- a read of what neither holds decompresses the record batches its samples are in, and keeps them
  a while (`loader.batchcache`); a remote shard's are fetched one by one by the byte range its
  sample index records, and decoded by `range_batch`.

The plain file keeps the stored record batches row for row, so a sample index's (batch, row) of
each sample stays right whichever of them reads it. Arrow decompresses without the GIL, so record
batches are decompressed on a pool's threads where one is given, each thread with its own reader
of the file (one reader is not documented safe to share), and written in order by the caller's
thread. Every Arrow failure becomes a `FormatError` naming the shard: the bytes were verified
against the manifest's hash before they got here, so the shard was written this way.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import pyarrow as pa

from .errors import FormatError

__all__ = ["ARROW_ERRORS", "Decompressor", "Pause", "range_batch"]

# What Arrow raises on bytes it cannot read: ArrowInvalid (a ValueError, as is a record batch number
# past the file's, which a damaged index asks for), an OSError for a truncated buffer,
# ArrowNotImplementedError for a codec this build lacks.
ARROW_ERRORS = (ValueError, pa.ArrowNotImplementedError, OSError, IndexError)
AHEAD = 2  # record batches decompressed ahead per pool thread by `write_plain`: bounds the memory in flight
_OPTIONS = pa.ipc.IpcReadOptions(use_threads=False)


class Pause(Protocol):
    """What a long rewrite asks between two record batches (`Decompressor.write_plain`)."""

    def wanted(self) -> bool:
        """True: the caller needs a moment with no record batch in flight (it may raise to stop)."""
        ...

    def quiet(self) -> None:
        """Called at such a moment: no thread of the rewrite reads the file or allocates for it."""
        ...


class Decompressor:
    """The Arrow IPC file ``data`` (a buffer, map or `pa.NativeFile`) of the shard ``name``.

    Opening reads its footer: `FormatError` where it is not an Arrow IPC file. (Arrow reads a
    record batch's buffers plain as they are where the file is not compressed, so this reads a
    plain shard as well, at no cost beyond the read.)"""

    def __init__(self, data, name: str):
        self.name = name
        self._src = data if isinstance(data, pa.NativeFile) else pa.py_buffer(data)
        self._local = threading.local()
        self.reader = self._open()
        self.schema: pa.Schema = self.reader.schema
        self.count: int = self.reader.num_record_batches

    def _open(self) -> pa.ipc.RecordBatchFileReader:
        try:
            return pa.ipc.open_file(self._src, options=_OPTIONS)
        except ARROW_ERRORS as e:
            raise FormatError(f"{self.name}: not a readable Arrow IPC file ({e})") from None

    def batch(self, k: int) -> pa.RecordBatch:
        """Record batch ``k``, decompressed, read with this thread's own reader."""
        reader = getattr(self._local, "reader", None)
        if reader is None:
            reader = self.reader if threading.current_thread() is threading.main_thread() else self._open()
            self._local.reader = reader
        try:
            return reader.get_batch(k)
        except ARROW_ERRORS as e:
            raise FormatError(f"{self.name}: record batch {k} cannot be decompressed ({e})") from None

    def batches(self, ks: Sequence[int], pool: ThreadPoolExecutor | None, threads: int) -> list[pa.RecordBatch]:
        """Record batches ``ks``, decompressed on ``pool``'s ``threads`` (in this thread without
        a pool), in the order asked; `FormatError` naming the first that fails."""
        ks = list(ks)
        if pool is None or threads < 2 or len(ks) < 2:
            return [self.batch(k) for k in ks]
        parts = [ks[t::threads] for t in range(threads)]
        done = list(pool.map(lambda part: [self.batch(k) for k in part], [p for p in parts if p]))
        out: list[pa.RecordBatch | None] = [None] * len(ks)
        for t, got in enumerate(done):
            out[t::threads] = got
        return out  # every slot filled: the parts cover ks

    def write_plain(
        self, sink: pa.NativeFile, pool: ThreadPoolExecutor | None = None, pause: Pause | None = None
    ) -> list[int]:
        """Write the file with every buffer uncompressed into ``sink``: the same record batches,
        row for row. Returns the rows of each batch. With a ``pool``, batches are decompressed on
        its threads, at most `AHEAD` a thread ahead of the writer. ``pause`` is asked between two
        batches. An `OSError` of ``sink`` (a fixed-size one that is full) propagates as it is; it
        returns only once no thread reads the file, so ``data`` and ``sink`` may then be closed."""
        rows: list[int] = []
        ahead = AHEAD * getattr(pool, "_max_workers", 1)
        inflight: deque[Future] = deque()
        try:
            with pa.ipc.new_file(sink, self.schema) as writer:

                def put(rb: pa.RecordBatch) -> None:
                    rows.append(rb.num_rows)
                    writer.write_batch(rb)

                nxt = 0
                while len(rows) < self.count:
                    if pause is not None and pause.wanted():
                        while inflight:
                            put(inflight.popleft().result())
                        pause.quiet()
                        continue
                    if pool is None:
                        put(self.batch(len(rows)))
                        continue
                    while nxt < self.count and nxt < len(rows) + ahead:
                        inflight.append(pool.submit(self.batch, nxt))
                        nxt += 1
                    put(inflight.popleft().result())
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise FormatError(f"{self.name}: cannot be rewritten plain ({e})") from None
        finally:
            for f in inflight:
                f.cancel()
            for f in inflight:
                if not f.cancelled():
                    f.exception()  # waits: its thread no longer reads the file
        return rows


def range_batch(data: bytes | memoryview, schema: pa.Schema, name: str) -> pa.RecordBatch:
    """One record batch of the shard ``name``, decompressed, from the byte range its sample index
    records for it (a message, not a whole file: the schema comes from the file's footer).
    `FormatError` naming the shard where it cannot be read.

    The first batch's range starts at the file's beginning (the writer emits the magic and the
    schema message with it), so leading non-batch messages are skipped."""
    try:
        buf = pa.py_buffer(data)
        if data[:6] == b"ARROW1":
            buf = buf.slice(8)
        messages = pa.ipc.MessageReader.open_stream(buf)
        while True:
            message = messages.read_next_message()
            if message.type == "record batch":
                return pa.ipc.read_record_batch(message, schema)
    except StopIteration:
        raise FormatError(f"{name}: a record batch's byte range holds no record batch") from None
    except ARROW_ERRORS as e:
        raise FormatError(f"{name}: a record batch cannot be decompressed from its byte range ({e})") from None
