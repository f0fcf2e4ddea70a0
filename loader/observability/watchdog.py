"""The stall watchdog: a batch not delivered within ``stall_timeout`` becomes an error that names
the rank, the batch, the shard and byte offset being read and the tier, with every stack on disk.

A thread per pass watches the trainer's wait for its next batch. When the wait passes the
limit it (1) writes the trainer's Python stacks (all threads) to a node-local dump file, (2)
asks every worker for its stacks: each worker registered `faulthandler` on `DUMP_SIGNAL` at
start, writing into its own anonymous file, which we copy into the dump; (3) reads from the
shared probe table what the owing process is reading; (4) interrupts the trainer's main thread
with `STALL_SIGNAL`, whose handler raises `StallInterrupt` only while that wait is still on.

A real signal, not ``_thread.interrupt_main``: a read blocked in C (``open`` of a FIFO, a hung
``pread``, a ``select`` on the workers' pipes) returns EINTR only for a signal delivered to its
thread; Python then runs the handler, whose exception ends the read. Handlers run only in the
main thread, so a pass iterated from another thread is not interrupted: the stall is logged
with its dump at the limit, and the error is raised when the wait ends (the pool's own
``timeout`` bounds it with workers).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import threading
import time
import weakref

from ..shmring import anonymous_fd
from .probe import Table

log = logging.getLogger("shardtool.loader.watchdog")

# Real-time signals: nothing else in a training job (SLURM's USR1/USR2 warnings, torchrun's
# TERM) uses them; SIGUSR2/1 where there are none.
if hasattr(signal, "SIGRTMIN"):
    STALL_SIGNAL, DUMP_SIGNAL = signal.SIGRTMIN + 3, signal.SIGRTMIN + 4
else:
    STALL_SIGNAL, DUMP_SIGNAL = signal.SIGUSR2, signal.SIGUSR1
DUMP_WAIT_S = 2.0

_active: weakref.WeakSet[Watchdog] = weakref.WeakSet()


class StallInterrupt(BaseException):
    """Raised in the main thread by the stall signal; turned into a LoaderError by the pass.

    A BaseException so that no ``except Exception`` in a read path (ours or fsspec's) swallows it.
    """


def _on_stall_signal(signum, frame) -> None:
    for wd in list(_active):
        if wd.fired is not None and wd.waiting_for == wd.fired:
            raise StallInterrupt()


class Watchdog:
    """One per loader; ``start_pass``/``stop`` around a pass, ``begin``/``end`` around each wait."""

    def __init__(
        self, table: Table, workers: int, stall_timeout: float, *, dump_dir: str, describe, details: bool = True
    ):
        self.table = table
        self.details = details  # the table has what each process is reading (metrics on)
        self.workers = workers
        self.timeout = float(stall_timeout)
        self.dump_dir = dump_dir  # node-local directory for the stack dump
        self.describe = describe  # (activity dict) -> "shard X at byte offset Y ..." text
        self.dump_fds: list[int] = []  # per pass, made before the workers fork
        self._finalizer: weakref.finalize[[list[int]], Watchdog] | None = None  # closes the dump files
        self.waiting_for: int | None = None
        self.since = 0.0
        self.fired: int | None = None  # the batch the stall was declared for
        self.error: str | None = None
        self.where = ""
        self._lock = threading.Lock()
        self._stop: threading.Event | None = None
        self._main = False

    # ------------------------------------------------------------------ worker side
    def worker_init(self, w: int) -> None:
        """In worker ``w`` at start: its stacks on request, into its own anonymous file."""
        faulthandler.register(DUMP_SIGNAL, file=self.dump_fds[w], all_threads=True, chain=False)

    # ------------------------------------------------------------------ trainer side
    def start_pass(self, where: str) -> None:
        """Before the pass's workers fork: they inherit their dump files."""
        self.dump_fds = [anonymous_fd(0) for _ in range(self.workers)]
        self._finalizer = weakref.finalize(self, _close_fds, self.dump_fds)
        self.where = where
        self.fired = self.error = self.waiting_for = None
        self._main = threading.current_thread() is threading.main_thread()
        if self._main and signal.getsignal(STALL_SIGNAL) is not _on_stall_signal:
            signal.signal(STALL_SIGNAL, _on_stall_signal)
        _active.add(self)

    def arm(self, extra_check=None) -> None:
        """After the workers forked (a fork copies no thread, but could copy a lock one holds):
        the watching thread, which also runs ``extra_check`` every poll."""
        self._stop = threading.Event()
        threading.Thread(
            target=self._watch, args=(self._stop, extra_check), name="shardtool-watchdog", daemon=True
        ).start()

    def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()
            self._stop = None
        _active.discard(self)
        self.waiting_for = None
        if self._finalizer is not None:
            self._finalizer()  # the workers are gone: their dump files too
            self._finalizer = None

    def _watch(self, stop: threading.Event, extra_check) -> None:
        poll = min(1.0, max(self.timeout / 8, 0.05))
        while not stop.wait(poll):
            if extra_check is not None:
                try:
                    extra_check()
                except Exception as e:  # noqa: BLE001 - a failed side check must not end the watch
                    log.debug("watchdog side check failed: %s", e)
            b = self.waiting_for
            if b is None:
                continue
            if self.fired is None and time.perf_counter() - self.since >= self.timeout:
                self.fire(b)
            if self.fired is not None and self.fired == self.waiting_for and self._main:
                # Again every poll: a handler's exception can be swallowed by code that catches
                # BaseException; the read must not outlive the stall.
                main = threading.main_thread().ident
                if main is None:
                    raise RuntimeError("shardtool internal error: the main thread has started: it runs this program")
                signal.pthread_kill(main, STALL_SIGNAL)

    def fire(self, b: int) -> str:
        """Declare batch ``b`` stalled: dump every stack, build the message (once per pass)."""
        with self._lock:
            if self.fired is not None:
                if self.error is None:
                    raise RuntimeError("shardtool internal error: set before fired, below")
                return self.error
            waited = time.perf_counter() - self.since
            path = self._dump()
            self.error = (
                f"{self.where}: batch {b} was not delivered within stall_timeout={self.timeout:g} s "
                f"(waited {waited:.1f} s): {self._reading(b)}. Python stacks of the trainer and its "
                f"{self.workers} worker(s): {path}"
            )
            log.error("%s", self.error)
            self.fired = b
            return self.error

    def _reading(self, b: int) -> str:
        if not self.details:
            return "no read details (metrics=False)"
        if self.workers:
            acts = {r: self.table.activity(r) for r in range(1, self.workers + 1)}
        else:  # the trainer reads batch b itself, inside next()
            acts = {0: self.table.activity(0, batch=b, waited=time.perf_counter() - self.since)}
        found = next(((r, a) for r, a in acts.items() if a is not None and a["batch"] == b), None)
        if found is None:
            busy = [f"worker {r - 1}: batch {a['batch']}, {self.describe(a)}" for r, a in acts.items() if a]
            return f"no process is reading batch {b}" + (f" ({'; '.join(busy)})" if busy else "")
        owner, act = found
        who = f"worker {owner - 1} (pid {act['pid']})" if self.workers else "the trainer"
        return f"{who} is {self.describe(act)}"

    def _dump(self) -> str:
        directory = self.dump_dir
        path = os.path.join(directory, f"stall-{os.getpid()}-{time.strftime('%Y%m%d-%H%M%S')}.log")
        try:
            os.makedirs(directory, exist_ok=True)
            with open(path, "w") as f:
                f.write(f"{self.where}: stall; trainer pid {os.getpid()}, all threads:\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
                pids = dict(self.table.pids())
                for w, text in enumerate(self._worker_stacks(pids)):
                    f.write(f"\n--- worker {w} (pid {pids.get(w + 1, '?')}):\n{text}")
        except OSError as e:
            return f"(could not write {path}: {e})"
        return path

    def _worker_stacks(self, pids: dict[int, int]) -> list[str]:
        """Each worker's stacks (faulthandler, on DUMP_SIGNAL) from its anonymous file."""
        for fd in self.dump_fds:
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)  # the workers share this offset: their dump starts at 0
        asked = []
        for w in range(self.workers):
            pid = pids.get(w + 1)
            if pid:
                try:
                    os.kill(pid, DUMP_SIGNAL)
                    asked.append(w)
                except OSError:
                    pass
        deadline = time.monotonic() + DUMP_WAIT_S
        sizes: dict[int, int] = {}
        while asked and time.monotonic() < deadline:
            time.sleep(0.05)
            now = {w: os.fstat(self.dump_fds[w]).st_size for w in asked}
            if all(now[w] > 0 for w in asked) and now == sizes:
                break  # every asked worker wrote, and nothing grew since the last look
            sizes = now
        out = []
        for w in range(self.workers):
            fd = self.dump_fds[w]
            data = os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")
            out.append(data or ("(no stack: the worker had not started)" if w not in asked else "(no answer)"))
        return out


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
