"""Worker processes that read batches into reusable shared-memory slots, delivered in order.

Batch ``b`` of a pass over ``range(start, n)`` goes to worker ``(b - start) % W`` and to that
worker's slot ``(b - start) // W % prefetch_factor``. Each worker has ``prefetch_factor``
batches in flight; after the trainer copies batch ``b`` out of its slot, it sends the same
worker batch ``b + W * prefetch_factor`` into the same slot. So results are consumed in batch
order whatever worker finishes first, and the batch sequence never depends on ``num_workers``.

Only small metadata crosses the pipe, pickled with plain `pickle`: multiprocessing's own
pickler, as extended by torch, would give every tensor its own new shared-memory segment
(the per-batch cost of descriptor passing, mmap and munmap this module exists to avoid).

A worker that raises sends its exception, which the trainer raises as itself (type, arguments
and notes, plus a note with the worker's traceback; `WorkerRaised` where it cannot be rebuilt);
one that dies, or sends nothing for ``timeout`` seconds, is a `WorkerFailed` in the trainer.
Workers are forked (they inherit the slots and the plan) and exit when told, when their pipe
closes, or when the trainer is gone.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import signal
import time
import traceback
import weakref
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

from ..format.errors import add_note
from .shmring import Slot, decode, encode

POLL_PARENT_S = 1.0


class WorkerFailed(RuntimeError):
    """A worker process died, exited or hung while loading a batch."""


class WorkerRaised(Exception):
    """User code raised in a worker an exception that cannot be rebuilt in the trainer as itself
    (it does not survive pickling); the message carries its type, text and the worker's traceback."""


class WorkerPool:
    """Iterator over ``load(b, alloc)`` for b in ``range(start, n)``, computed by worker processes."""

    def __init__(
        self,
        load: Callable[[int, Callable], Any],
        start: int,
        n: int,
        *,
        num_workers: int,
        prefetch_factor: int,
        timeout: float,
        pin: bool = False,
        worker_init: Callable[[int], None] | None = None,
    ):
        self.start, self.n, self.next_b = start, n, start
        self.workers, self.depth = num_workers, prefetch_factor
        self.timeout, self.pin = timeout, pin
        ctx = mp.get_context("fork")  # workers share the plan and the slots by inheritance
        self.slots = [[Slot() for _ in range(prefetch_factor)] for _ in range(num_workers)]
        self.conns: list = []
        self.procs: list = []
        self._finalizer = weakref.finalize(self, _shutdown, self.procs, self.conns, self.slots)
        parent = os.getpid()
        # Frozen, the objects the workers inherit are never collected in them: garbage the trainer
        # left (an earlier loader's s3fs session, say) would otherwise run its finalizer in a
        # worker, against an event loop that is not there ("attached to a different loop"), and
        # collections would copy pages the workers share (gc.freeze's documented use with fork).
        gc.freeze()
        try:
            self._start(load, ctx, parent, worker_init)
        finally:
            gc.unfreeze()  # the trainer collects its own garbage again
        for b in range(start, min(n, start + num_workers * prefetch_factor)):
            self._send(b)

    def _start(self, load: Callable, ctx, parent: int, worker_init: Callable[[int], None] | None) -> None:
        for w in range(self.workers):
            mine, theirs = ctx.Pipe(duplex=True)
            self.conns.append(mine)
            p = ctx.Process(
                target=_worker_main,
                args=(load, theirs, self.slots[w], parent, list(self.conns), worker_init, w),
                name=f"shardtool-loader-{w}",
                daemon=True,
            )
            p.start()
            theirs.close()
            self.procs.append(p)

    def _where(self, b: int) -> tuple[int, int]:
        i = b - self.start
        return i % self.workers, i // self.workers % self.depth

    def _send(self, b: int) -> None:
        w, k = self._where(b)
        try:
            self.conns[w].send_bytes(pickle.dumps((b, k)))
        except OSError:
            pass  # the worker is gone; the next receive from it says how

    def __iter__(self) -> WorkerPool:
        return self

    def __next__(self) -> Any:
        b = self.next_b
        if b >= self.n:
            self.close()
            raise StopIteration
        w, k = self._where(b)
        msg = self._receive(w, b)
        if msg[0] == "err":
            raise pickle.loads(msg[2]) if msg[2] is not None else WorkerRaised(msg[3])
        batch = decode(msg[2], self.slots[w][k], self.pin)
        nxt = b + self.workers * self.depth
        if nxt < self.n:
            self._send(nxt)  # the slot is free again: batch b was copied out
        self.next_b = b + 1
        return batch

    def _receive(self, w: int, b: int) -> tuple:
        conn, proc = self.conns[w], self.procs[w]
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            # A worker that keeps ahead has the batch waiting: one poll of its pipe, without the
            # selector that wait() builds, registers and closes on every call.
            ready = [conn] if conn.poll(0) else wait([conn, proc.sentinel], timeout=max(left, 0))
            if conn in ready:
                try:
                    msg = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    proc.join(1.0)
                    raise WorkerFailed(
                        f"worker {w} (pid {proc.pid}) {_exit_reason(proc)} while loading batch {b}"
                    ) from None
                if msg[1] != b:
                    raise WorkerFailed(f"worker {w} sent batch {msg[1]} when batch {b} was due")
                return msg
            if ready:
                proc.join(1.0)
                raise WorkerFailed(f"worker {w} (pid {proc.pid}) {_exit_reason(proc)} while loading batch {b}")
            if left <= 0:
                raise WorkerFailed(f"worker {w} (pid {proc.pid}) timed out: no batch {b} after {self.timeout:g} s")

    def close(self) -> None:
        self._finalizer()


def _exit_reason(proc) -> str:
    code = proc.exitcode
    if code is None:
        return "closed its pipe"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _shutdown(procs: list, conns: list, slots: list) -> None:
    for c in conns:
        try:
            c.send_bytes(pickle.dumps(None))
        except OSError:
            pass
    deadline = time.monotonic() + 2.0
    for p in procs:
        p.join(max(deadline - time.monotonic(), 0))
    for p in procs:
        if p.is_alive():
            p.kill()  # hung in user code: it holds nothing the trainer needs
            p.join(1.0)
        try:
            p.close()  # its sentinel descriptor, now rather than when the last reference goes
        except ValueError:
            pass
    for c in conns:
        c.close()
    for row in slots:
        for s in row:
            s.close()
    procs.clear()
    conns.clear()


# ---------------------------------------------------------------------- worker process
def _worker_main(
    load: Callable,
    conn,
    slots: list[Slot],
    parent: int,
    parent_ends: list,
    worker_init: Callable[[int], None] | None = None,
    w: int = 0,
) -> None:
    for c in parent_ends:  # so that our pipe (and our siblings') sees EOF when the trainer dies
        c.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    if worker_init is not None:
        # First: it announces the worker and registers its stack dump, so a worker that hangs in
        # what follows (once, in CI, a worker never got this far) shows where in a stall report.
        worker_init(w)
    import torch

    # Reading and decoding are numpy-vectorised; intra-op threads per worker only oversubscribe.
    # And it is what makes a fork safe: a trainer that ran a model has a used OpenMP pool, which
    # the child inherits without its threads; with one intra-op thread ATen runs ops inline and
    # MKL/oneDNN stay serial, so a transform's torch ops never wait on that pool (test_loader_fork_omp).
    torch.set_num_threads(1)
    while True:
        try:
            while not conn.poll(POLL_PARENT_S):
                if os.getppid() != parent:
                    return
            task = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        if task is None:
            return
        b, k = task
        slot = slots[k]
        try:
            slot.reset()
            out = pickle.dumps(("ok", b, encode(load(b, slot.empty), slot)), pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            out = pickle.dumps(("err", b, *_crossing(e)))
        try:
            conn.send_bytes(out)
        except OSError:
            return


def _crossing(e: Exception) -> tuple[bytes | None, str]:
    """(the pickled exception, or None where it would not unpickle as itself; its full text)."""
    where = f"in loader worker (pid {os.getpid()}):\n" + "".join(traceback.format_tb(e.__traceback__))
    text = f"{type(e).__name__} " + where + "".join(traceback.format_exception_only(e))
    try:
        add_note(e, where.rstrip("\n"))
        blob = pickle.dumps(e)
        pickle.loads(blob)  # here, not in the trainer, where a failure would look like a dead worker
        return blob, text
    except Exception:
        return None, text
