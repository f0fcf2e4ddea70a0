"""A pass of `ShardedLoader`: its batches handed over in order, its workers ended with it.

The generator a pass returns runs inside the user's ``next()`` calls (so the wait the metrics
report is what the user measures around ``next()``), ends its worker pool however the consumer
leaves it, and agrees with the other ranks once per epoch that they read the same plan.
A mixin of `ShardedLoader`: it reads the loader's ``batch_source`` (whose position each batch
handed over moves), ``_obs``, ``_staging`` and the worker options.
"""

from __future__ import annotations

import atexit
import numbers
import time
import weakref
from collections.abc import Iterator
from typing import Any

from .agree import disagreement, in_process_group
from .batchsource import BatchSource, PassBatches
from .collate import unpack_batch
from .errors import LoaderError
from .observability.probe import NO_PROBE
from .pool import WorkerFailed
from .readahead import hand_down_first
from .remotefetch import drop_handed
from .workers import make_dataloader


def _with_valid(batch: Any, valid: Any, where: str) -> Any:
    """An exact pass's batch with its ``valid`` mask (a dict batch: the loader's, or a user
    collate_fn's that returns a mapping)."""
    if not isinstance(batch, dict):
        raise LoaderError(
            f"{where}: exact=True marks padding in batch['valid'], but the collate_fn returned a "
            f"{type(batch).__name__}, not a dict: return a dict from collate_fn"
        )
    batch["valid"] = valid
    return batch


class PassRunner:
    """The pass machinery, and the metrics of passes, that `ShardedLoader` inherits."""

    # Set by ShardedLoader.__init__.
    batch_source: BatchSource
    _obs: Any  # loader/observability/observe.py's Observer
    _staging: Any  # loader/rankstaging.py's Staging, or None
    num_workers: int
    prefetch_factor: int
    pin_memory: bool
    timeout: float
    rank: int
    layout: Any
    # Set by the first pass (`_track`): a weak reference to the pass's generator, None once closed.
    _pass: weakref.ReferenceType[Iterator[Any]] | None

    def _settle(self) -> None:
        """Once every batch of the epoch was handed over, the loader is in the next epoch, whether
        or not the consumer asked for one more batch and saw StopIteration: a trainer that stops
        after len(loader) batches (Lightning does) gets the next epoch from its next iter()."""
        if self.batch_source.at_end():
            self._close_pass()
            self.batch_source.next_pass()

    def _track(self, run: Iterator[Any]) -> Iterator[Any]:
        # A weak reference: the pass must still end (its workers exit) as soon as the consumer
        # drops it, as a loop that breaks out does; a strong one would be a cycle through self.
        self._pass = weakref.ref(run)
        _running.add(self)
        return run

    def _before_first_batch(self, what: str) -> None:
        """Refuse ``what`` while a pass is under way: it changes which batches the pass serves."""
        live = getattr(self, "_pass", None)
        if live is not None and live() is not None:
            raise ValueError(f"{what} must come before the pass's first batch: a pass is under way")

    def close(self) -> None:
        """End the pass under way (its workers exit); `ShardedLoader.close` closes the rest."""
        self._close_pass()

    def _close_pass(self) -> None:
        """End the previous pass's generator (its worker pool) before another begins: a consumer
        that stops at len(loader), or breaks out early and keeps it, leaves it suspended."""
        ref, self._pass = getattr(self, "_pass", None), None
        previous = ref() if ref is not None else None
        if previous is not None:
            previous.close()

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[Any]:
        self._settle()
        self._close_pass()
        return self._track(self._from_first_batch())

    def _from_first_batch(self) -> Iterator[Any]:
        # A generator: the pass is decided at the first next(), not at iter(). Trainers call
        # iter() before they restore the state (Lightning tests that the object is iterable, and
        # builds its fetcher, before loading the checkpoint's loader state): the pass continues
        # the position loaded in between.
        # The first next() waits from here: the ranks' agreement and the pass's plan (a remote
        # dataset's lengths read for it) are part of the wait the trainer sees.
        entered = time.perf_counter()
        source = self.batch_source
        if source.at_end():  # a loaded state at the end of an epoch is the next one's start
            source.next_pass()
        if self._in_process_group():
            source.check_ranks_agree(self._agree)
        one = source.begin_pass()
        if self._staging is not None and one.plan is not None:
            self._staging.begin_pass(source.metric_epoch, one.plan, one.start)
        yield from self._run(one, entered)

    # ------------------------------------------------------------------ observability
    def metrics(self) -> dict[str, Any]:
        """This rank's loader metrics as a plain dict, cheap enough to call every step.

        ``cumulative``: since the first batch was asked for; ``window``: since the previous call.
        Each has the time the training loop spent inside ``next()`` (``wait_s``, ``wait_fraction``:
        every call from entry to return, the one that ends a pass included; see
        docs/observability.md for what that covers),
        the time workers spent producing batches, samples/tokens per second and padding
        efficiency (tokens from the index lengths), bytes read per tier (node ``cache``, ``local``
        files read in place, ``remote``: ranged reads plus whole shards fetched on a cache miss),
        cache hits/misses/fetched bytes, shard opens with p50/p99 open latency, tokens per source,
        and worker starts/restarts. ``cache_behind_shards``: shards of the next batches that are
        neither cached nor being fetched, at the last check. Workers read ahead and publish their
        byte counts every few batches, so their counters may lead or trail the batches handed over
        by a few; at the end of a pass they are exact.
        """
        source = self.batch_source
        return self._obs.metrics(source.metric_epoch, source.served)

    def report_step_time(self, seconds: float) -> None:
        """The time the trainer spent on the batch handed over last, for `shardtool stats` to say
        how much of each step the ranks wait for the slowest (with ``micro_batches``, report each
        micro-batch; a step's add up). Time the rank's own work (forward and backward, e.g. under
        DDP's ``no_sync()``, or until the backward's all-reduce is launched): a time that
        includes the all-reduce is the slowest rank's on every rank. Several reports for one
        batch add up (forward and backward timed apart). Recorded in a later metric line
        (``metrics_every``); needs ``metrics=True``."""
        source = self.batch_source
        if source.served < 1:
            raise ValueError("report_step_time: no batch has been handed over yet")
        if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or not 0 <= seconds < float("inf"):
            # A NaN would make every rank's step sum NaN and stats report no time lost at all.
            raise ValueError(f"report_step_time: seconds must be a finite number >= 0, found {seconds!r}")
        self._obs.step_time(source.metric_epoch, source.served - 1, seconds)

    @property
    def metrics_path(self) -> str:
        """This rank's JSONL file of metric lines (one per ``metrics_every`` steps; node-local by default)."""
        return self._obs.file.path

    @property
    def rank_summary(self) -> dict | None:
        """The last cross-rank summary (``metrics_reduce=True``): min/median/max, the slowest rank."""
        return self._obs.rank_summary

    # ------------------------------------------------------------------ a pass
    def _run(self, one: PassBatches, entered: float) -> Iterator[Any]:
        # The body runs inside the user's next() calls: each is timed from its entry (``entered``
        # for the first, then after each yield) to its return, so wait_s is what the user
        # measures around next().
        batches, start, n, where = one.batches, one.start, one.stop, one.where
        source = self.batch_source
        epoch = source.metric_epoch
        watch = self._obs.begin_pass(batches, start, n, where, epoch, entered)  # before the workers fork
        try:
            if self.num_workers:  # remote record batches for the workers' first batches, before the fork
                hand_down_first(batches, start, self.num_workers * self.prefetch_factor)
            batches.inflate(start)  # compressed shards read in place: once per rank, before the fork
            dl = make_dataloader(
                batches,
                start,
                num_workers=self.num_workers,
                prefetch_factor=self.prefetch_factor,
                pin_memory=self.pin_memory,
                timeout=self.timeout,
                worker_init=self._obs.worker_init,
                probe=self._obs.probe or NO_PROBE,
            )
        except BaseException:
            self._obs.end_pass(complete=False)
            raise
        finally:
            drop_handed()  # the workers forked with their copies
        it = iter(dl)
        ended = None  # an error, or the loop left early: the pass ends outside any next()
        served = source.served
        try:
            for b in range(start, n):
                try:
                    batch = watch.next(it, b, entered, unpack_batch)
                except StopIteration:
                    raise LoaderError(f"{where}: the reader stopped after {b} of {n} batches") from None
                except WorkerFailed as e:
                    # The worker pool's own failures: a worker killed, exited or timed out. Anything
                    # else (our reader's errors, the user's transform or collate_fn) is raised as
                    # itself, with notes naming the batch and its shards.
                    raise LoaderError(
                        f"{where}: batch {b} could not be loaded ({batches.describe(b)}): "
                        f"a worker process failed, exited or was killed ({type(e).__name__}: {e})"
                    ) from e
                if batches.pad is not None:
                    batch = _with_valid(batch, batches.valid(b), where)
                served = source.handed_over(b)
                if self._staging is not None:
                    self._staging.served(epoch, served)
                yield batch
                entered = time.perf_counter()
            ended = entered  # this next() ends the pass: closing the workers is part of it
        finally:
            it.close()  # the worker pool, or the in-process generator
            self._obs.end_pass(complete=served >= n, entered=ended, at=(epoch, n))
        source.next_pass()

    def _in_process_group(self) -> bool:
        return in_process_group(self.layout.world_size, self.rank)

    def _agree(self, numbers: list[int], ident: str, what: str, fix: str) -> None:
        """LoaderError naming the ranges if any rank differs on ``numbers`` or ``ident``."""
        message = disagreement(self.rank, numbers, ident, what, fix)
        if message is not None:
            raise LoaderError(message)


# Loaders whose pass is still suspended when the interpreter exits (a script that stopped mid-pass
# and kept the iterator) are closed by atexit, while the modules their ending uses are still there: left
# to the garbage collector at teardown, they raised "Exception ignored" from numpy set to None.
_running: weakref.WeakSet = weakref.WeakSet()


def _end_running_passes() -> None:
    for runner in list(_running):
        try:
            runner.close()
        except Exception:  # noqa: S110 - the interpreter is exiting: nothing is left to tell
            pass


atexit.register(_end_running_passes)
