"""Everything the loader observes about itself, behind two hooks in its iteration loop.

`Observer` owns the shared counter table (observability/probe.py), the trainer-side `Meter`, the
metric lines and cross-rank summary (observability/metricslog.py), the stall `Watchdog` and the
check that the node cache is ahead of the plan. `ShardedLoader` calls `worker_init` in each
worker, `begin_pass` once per pass and `Pass.next` instead of ``next()`` for every batch.

``wait_s`` is the time the training loop spends inside the loader's ``next()``, from entry to
return: the wait for a worker, unpacking, pinning, the metric line of that step, and in the first
call of a pass the start of the workers. The loader takes the entry time and hands it to
`begin_pass`, `Pass.next` and `end_pass` (the call that ends the pass closes the workers).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import numpy as np

from ...format import ShardtoolError
from ..errors import LoaderError
from . import metricslog
from .metrics import Meter, Snapshot
from .probe import BUSY_PHASE, CACHE, IDLE, NO_PROBE, PHASES, TIERS, Probe, Table
from .watchdog import StallInterrupt, Watchdog

log = logging.getLogger("shardtool.loader.metrics")
CACHE_CHECK_S = 5.0  # how often the watchdog thread looks at the cache ahead of the plan


class Observer:
    def __init__(
        self,
        readers: dict,
        placement,
        *,
        num_workers: int,
        prefetch_factor: int,
        metrics: bool,
        metrics_every: int | None,
        metrics_dir: str | None,
        metrics_reduce: bool,
        cache_dir: str | None,
        stall_timeout: float | None,
        env=os.environ,
    ):
        """``readers``: the dataset's reader under its URL, or a mixture's under its source names."""
        for name, flag in (("metrics", metrics), ("metrics_reduce", metrics_reduce)):
            # A path given here (meant for metrics_dir) would turn metrics on and write nowhere it says.
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be True or False (metrics_dir says where lines go), found {flag!r}")
        every = 0 if metrics_every is None else metrics_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"metrics_every must be an int >= 0 (0: no metric lines), found {metrics_every!r}")
        if stall_timeout is not None and not stall_timeout > 0:
            raise ValueError(f"stall_timeout must be > 0 seconds (None: no watchdog), found {stall_timeout!r}")
        self.readers = dict(readers)
        self.rank, self.layout, self.node = placement.rank, placement.layout, placement.node
        self.workers = num_workers
        self.lookahead = max(32, 4 * num_workers * prefetch_factor)
        self.staged = False  # in-job staging is on: set by the loader (loader/rankstaging.py)
        self.table = Table(num_workers + 1)  # with metrics off, only the workers' pids (for stack dumps)
        # One probe per process, shared by a mixture's readers: they read in the same process row.
        # None with metrics off: the workers time nothing, the readers count nothing (NO_PROBE).
        self.probe = Probe(self.table, num_workers) if metrics else None
        for reader in self.readers.values():
            reader.probe = self.probe or NO_PROBE
        self.meter = Meter(self.table, list(self.readers), in_process=num_workers == 0) if metrics else None
        self.every = every if metrics else 0
        self.reduce = metrics_reduce and metrics
        self.started = time.time()
        self.host = metricslog.host_name()
        self.run = metricslog.run_id(env, self.layout.world_size, os.getpid(), self.started)
        self.dir = metricslog.default_dir(metrics_dir, cache_dir, self.run, env)
        self.file = metricslog.MetricsFile(self.dir, self.host, self.rank)
        self._current: dict = {}  # the pass's batches, for the watchdog (no reference back to us)
        where = BatchStart(self.readers, self._current)
        self.watchdog = (
            Watchdog(
                self.table, num_workers, stall_timeout, dump_dir=self.dir, details=metrics, describe=where.describe
            )
            if stall_timeout is not None
            else None
        )
        self.cache_behind = 0
        self.rank_summary: dict | None = None
        self._user_since: Snapshot | None = None
        self._line_since: Snapshot | None = None
        self._lined_steps = 0  # the meter's steps at the last metric line
        self._pass_complete = True
        self._pass_epoch: int | None = None
        # Under a cost model: the pass's batch costs and the first not yet in a metric line, and
        # the step times the trainer reported since the last line (`shardtool stats` lines them
        # up across ranks: how long steps wait for the slowest rank).
        self._costs: Any = None  # sliced as costs[a:b] (a mixture's are computed when asked)
        self.micro = 1  # batches a step (gradient accumulation), as the loader's cost model counts them
        self._cost_from = 0
        self._times: list[list[float]] = []

    # ------------------------------------------------------------------ hooks
    def worker_init(self, w: int) -> None:
        if self.probe:
            self.probe.bind(w + 1)
        else:
            self.table.announce(w + 1)
        if self.watchdog is not None:
            self.watchdog.worker_init(w)

    def begin_pass(self, batches, start: int, n: int, where: str, epoch: int, entered: float) -> Pass:
        """``entered``: when the first ``next()`` of the pass was called (it starts the pass)."""
        # A pass that continues an epoch whose previous pass stopped early (an error, a stall,
        # a loop left and re-entered) started its workers again: those are restarts.
        restart = (not self._pass_complete) and self._pass_epoch == epoch and self.workers > 0
        self._pass_complete, self._pass_epoch = False, epoch
        self.table.a[0, BUSY_PHASE] = IDLE  # a read left by an error of the last pass is over
        if self.meter is not None:
            batches.start_meter(self.meter, self.workers, restart, entered)
        self._current["batches"] = batches
        costs = getattr(batches, "costs", None)
        self._costs, self._cost_from = costs, start
        p = Pass(self, batches, start, n, epoch)
        p.check_cache()  # at once: the first batches are the ones a cold cache stalls
        if self.watchdog is not None:
            self.watchdog.start_pass(where)
        return p

    def end_pass(self, complete: bool, entered: float | None = None, at: tuple[int, int] | None = None) -> None:
        """``entered``: when the ``next()`` that ended the pass was called, to count it as waiting
        (None: the pass ended outside a ``next()``, by an error or the loop left early). ``at``:
        (epoch, batches) of a pass served to its end, whose steps since the last metric line get a
        line of their own (their costs and step times were lost with the pass)."""
        self._pass_complete = complete
        if complete and at is not None and self.every and self.meter is not None:
            if self.meter.steps > self._lined_steps:  # every rank alike: equal counts, one rule
                self.line(*at)
        self._flush()
        if self.watchdog is not None:
            self.watchdog.stop()
        self.table.forget_workers()
        if entered is not None and self.meter is not None:
            self.meter.wait_s += time.perf_counter() - entered

    def _flush(self) -> None:
        """This process's uncounted batch bytes (with num_workers=0, the trainer reads them)."""
        if self.probe:
            self.probe.flush()

    def step_time(self, epoch: int, batch: int, seconds: float) -> None:
        """The trainer's time for batch ``batch`` (its compute, before the all-reduce that waits
        for every rank), kept for the next metric line."""
        self._times.append([int(epoch), int(batch), float(seconds)])

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        self.file.close()

    # ------------------------------------------------------------------ reporting
    def metrics(self, epoch: int, batch: int) -> dict:
        if self.meter is None:
            raise RuntimeError("shardtool internal error: this loader was made with metrics=False: it keeps no metrics")
        self._flush()
        now = self.meter.snapshot()
        out = self._report(self.meter, now, self._user_since, epoch, batch)
        self._user_since = now
        return out

    def _report(self, meter: Meter, now: Snapshot, since: Snapshot | None, epoch: int, batch: int) -> dict:
        return {
            "rank": self.rank,
            "world_size": self.layout.world_size,
            "node": self.node,
            "host": self.host,
            "epoch": epoch,
            "batch": batch,
            "step": meter.steps,
            "time": time.time(),
            "cache_behind_shards": self.cache_behind,
            "cumulative": meter.section(now),
            "window": meter.section(now, since),
        }

    def line(self, epoch: int, batch: int) -> None:
        """Every ``metrics_every`` steps: one JSON line, and the cross-rank summary if asked for."""
        meter = self.meter
        if meter is None:
            raise RuntimeError("shardtool internal error: every > 0 only with metrics on, which made the meter")
        self._flush()
        now = meter.snapshot()
        out = self._report(meter, now, self._line_since, epoch, batch)
        self._line_since, self._lined_steps = now, meter.steps
        out.update(v=metricslog.LINE_VERSION, run=self.run, pid=os.getpid(), start=self.started)
        if self._costs is not None and batch > self._cost_from:
            costs = [float(c) for c in self._costs[self._cost_from : batch]]
            out["batch_costs"] = {"from": self._cost_from, "cost": costs}
            self._cost_from = batch
        if self._times:
            out["step_times"], self._times = self._times, []
        if "batch_costs" in out or "step_times" in out:
            out["micro_batches"] = self.micro
        if self.reduce:
            s = metricslog.reduce_ranks(
                out["window"], rank=self.rank, world_size=self.layout.world_size, node=self.node
            )
            if s is not None:
                self.rank_summary = s
                if self.rank == 0:
                    out["ranks"] = s
                    log.info("%s", metricslog.format_summary(s, out["step"]))
            else:
                self.reduce = False
                log.warning(
                    "rank %d: metrics_reduce needs an initialised torch.distributed process group whose "
                    "ranks are the loader's (rank %d of %d); no cross-rank summary",
                    self.rank,
                    self.rank,
                    self.layout.world_size,
                )
        self.file.append(out)


class BatchStart:
    """What a process is doing, in words, from its probe row and the plan (for the stall error).

    Reads from memory maps are not announced per batch (that would cost more than the rest of
    the metrics): for a process inside a batch but in no announced open, fetch or ranged read,
    the plan says where the batch begins, and the trainer's copy of that shard's index the
    byte offset (read here with a short limit: the index may sit on the very mount that hangs).
    """

    INDEX_WAIT_S = 1.0

    def __init__(self, readers: dict, current: dict):
        self.readers, self.current = readers, current
        self.reader = next(iter(readers.values()))

    def shard_name(self, s: int) -> str:
        names = {n: r.source.dataset.manifest.shards for n, r in self.readers.items()}
        if len(names) == 1:
            (shards,) = names.values()
            return shards[s].path if 0 <= s < len(shards) else f"#{s}"
        # A mixture's probe row holds a shard number, not its source: every source's shard of that number.
        return (
            f"#{s} (" + " or ".join(f"source {n!r}: {sh[s].path}" for n, sh in names.items() if 0 <= s < len(sh)) + ")"
        )

    def describe(self, act: dict) -> str:
        if act["phase"] != PHASES[0]:
            name = self.shard_name(act["shard"])
            size = f", {act['size']} bytes" if act["size"] else ""
            return (
                f"{act['phase']} shard {name} at byte offset {act['offset']}{size} (tier {act['tier']}) "
                f"for {act['for_s']:.1f} s"
            )
        return (
            f"inside batch {act['batch']} for {act['for_s']:.1f} s, in no open, fetch or ranged read (so reading "
            f"from the memory-mapped shards, or decoding, transforming, collating: the stacks say which); "
            f"{self.begins(act['batch'])}"
        )

    def begins(self, b: int) -> str:
        batches = self.current.get("batches")
        if batches is None or not 0 <= b < len(batches):
            return f"batch {b} is not in this pass"
        if not hasattr(batches, "batch_ids"):  # a mixture's step: its units of each source
            return f"step {b} reads {batches.describe(b)}"
        ids = batches.batch_ids(b)
        if not len(ids):
            return f"batch {b} is not in this pass"
        shard, local = self.reader.locate(ids[:1])
        s, i = int(shard[0]), int(local[0])
        src = self.reader.source
        done: list = []
        t = threading.Thread(target=lambda: done.append(int(src.dataset.shard_index(s).offsets[i])), daemon=True)
        t.start()
        t.join(self.INDEX_WAIT_S)
        at = (
            f"byte offset {done[0]}" if done else f"sample #{i} (its index did not load within {self.INDEX_WAIT_S:g} s)"
        )
        return f"batch {b} begins at shard {src.dataset.manifest.shards[s].path} {at} (tier {TIERS[src.tier - 1]})"


class Pass:
    """One pass over ``range(start, n)``: timing, accounting and the watchdog around each batch."""

    def __init__(self, obs: Observer, batches, start: int, n: int, epoch: int):
        self.obs, self.batches, self.n, self.epoch = obs, batches, n, epoch
        self.meter, self.wd, self.every = obs.meter, obs.watchdog, obs.every
        self.position = start
        self._armed = self.wd is None  # the watchdog thread starts at the first wait, after the fork
        self._next_cache_check = 0.0
        self._warned = False

    def next(self, it, b: int, entered: float, unpack):
        """Batch ``b`` from ``it``, through ``unpack``; counted as handed over, with the whole
        ``next()`` call since ``entered`` as waiting (the watchdog times only the read)."""
        wd = self.wd
        if not self._armed:
            if wd is None:
                raise RuntimeError(
                    "shardtool internal error: unarmed only with a watchdog (`_armed` starts True without one)"
                )
            self._armed = True
            wd.arm(self.check_cache)
        began = time.perf_counter()
        if wd is not None:
            wd.since, wd.waiting_for = began, b
        try:
            try:
                batch = next(it)
            finally:
                wait = time.perf_counter() - began
                if wd is not None:
                    wd.waiting_for = None
        except StallInterrupt:
            if wd is None:
                raise RuntimeError("shardtool internal error: only a watchdog's signal raises it") from None
            wd.waiting_for = None  # first: no second interrupt may land outside this wait
            raise self._stalled(b) from None
        except (RuntimeError, EOFError, OSError) as e:
            # The pool's own timeout may run out first (both default to 300 s): same stall, same report.
            if wd is not None and not isinstance(e, ShardtoolError) and (wd.fired == b or wait >= wd.timeout):
                raise self._stalled(b) from e
            raise
        if wd is not None and wd.fired == b:
            raise self._stalled(b)  # declared stalled from a thread we could not interrupt
        self.position = b + 1
        batch = unpack(batch)  # in the trainer, inside the user's next(): waiting too
        m = self.meter
        if m is not None:  # Meter.delivered, inlined: a call per step costs more than the counting
            now = time.perf_counter()
            m.wait_s += now - entered
            m.steps += 1
            if m.per_step is None:
                m.samples += m.batch_samples[b]
                m.tokens += m.batch_tokens[b]
                m.padded += m.batch_padded[b]
            else:
                m.count_step(b)
            if self.every and m.steps % self.every == 0:
                self.obs.line(self.epoch, b + 1)
                m.wait_s += time.perf_counter() - now  # the line is written inside next() as well
        return batch

    def _stalled(self, b: int) -> LoaderError:
        if self.wd is None:
            raise RuntimeError("shardtool internal error: a stall is the watchdog's")
        return LoaderError(self.wd.fire(b))

    def check_cache(self) -> None:
        """In the watchdog thread: warn when the shards of the next batches are neither in the
        node cache nor being fetched (no warm running for them) — before the GPUs wait."""
        now = time.monotonic()
        if now < self._next_cache_check:
            return
        self._next_cache_check = now + CACHE_CHECK_S
        if not hasattr(self.batches, "ids"):
            return  # a mixture's steps: no one id table to look ahead in (not checked)
        (reader,) = self.obs.readers.values()
        src = reader.source
        if src.tier != CACHE:
            return
        b = self.position
        offs = self.batches.offsets
        ids = self.batches.ids[offs[b] : offs[min(b + self.obs.lookahead, self.n)]]
        shards = np.unique(reader.locate(ids)[0]).tolist() if len(ids) else []
        missing = [s for s in shards if not src.is_cached(s) and not src.being_fetched(s)]
        self.obs.cache_behind = len(missing)
        # With in-job staging the stager fetches them, a bounded distance ahead: nothing to warn of.
        if missing and not self._warned and not self.obs.staged:
            self._warned = True
            m = src.dataset.manifest
            log.warning(
                "rank %d: the node cache is behind the plan: %d of the %d shards the next %d batches read "
                "are not cached and nobody is fetching them (no warm running), e.g. %s; each will be "
                "fetched from the source a few batches before one needs it (prefetch_factor), which stalls "
                "batches wherever a fetch takes longer than those steps. Run `shardtool warm` for this node "
                "(e.g. in the job prolog), or stage in the job (stage=True).",
                self.obs.rank,
                len(missing),
                len(shards),
                min(self.obs.lookahead, self.n - b),
                m.shards[missing[0]].path,
            )
