"""A pass of `ShardedLoader`: its batches handed over in order, its workers ended with it.

The generator a pass returns runs inside the user's ``next()`` calls (so the wait the metrics
report is what the user measures around ``next()``), ends its worker pool however the consumer
leaves it, and agrees with the other ranks once per epoch that they read the same plan.
A mixin of `ShardedLoader` (and through it `MixtureLoader`): the state it reads and writes is the
loader's (``_served``, ``_epoch``, ``_obs``, ``_staging``, the worker options).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator
from typing import Any

from ..plan import RankPlan
from .agree import disagreement, in_process_group
from .collate import unpack_batch
from .errors import LoaderError
from .pool import WorkerFailed
from .workers import PlanBatches, make_dataloader


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
    """The pass machinery `ShardedLoader` inherits."""

    def _track(self, run: Iterator[Any]) -> Iterator[Any]:
        # A weak reference: the pass must still end (its workers exit) as soon as the consumer
        # drops it, as a loop that breaks out does; a strong one would be a cycle through self.
        self._pass = weakref.ref(run)
        return run

    def _before_first_batch(self, what: str) -> None:
        """Refuse ``what`` while a pass is under way: it changes which batches the pass serves."""
        live = getattr(self, "_pass", None)
        if live is not None and live() is not None:
            raise ValueError(f"{what} must come before the pass's first batch: a pass is under way")

    def _close_pass(self) -> None:
        """End the previous pass's generator (its worker pool) before another begins: a consumer
        that stops at len(loader), or breaks out early and keeps it, leaves it suspended."""
        ref, self._pass = getattr(self, "_pass", None), None
        previous = ref() if ref is not None else None
        if previous is not None:
            previous.close()

    def _run(self, batches: PlanBatches, start: int, n: int, where: str) -> Iterator[Any]:
        # The body runs inside the user's next() calls: each is timed from its entry (here, and
        # after each yield) to its return, so wait_s is what the user measures around next().
        entered = time.perf_counter()
        watch = self._obs.begin_pass(batches, start, n, where, self._epoch, entered)  # before the workers fork
        try:
            batches.inflate(start)  # compressed shards read in place: once per rank, before the fork
            dl = make_dataloader(
                batches,
                start,
                num_workers=self.num_workers,
                prefetch_factor=self.prefetch_factor,
                pin_memory=self.pin_memory,
                timeout=self.timeout,
                worker_init=self._obs.worker_init,
                probe=self._obs.probe,
            )
        except BaseException:
            self._obs.end_pass(complete=False)
            raise
        it = iter(dl)
        ended = None  # an error, or the loop left early: the pass ends outside any next()
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
                self._served = self._position_after(b)
                if self._staging is not None:
                    self._staging.served(self._epoch, self._served)
                yield batch
                entered = time.perf_counter()
            ended = entered  # this next() ends the pass: closing the workers is part of it
        finally:
            it.close()  # the worker pool, or the in-process generator
            self._obs.end_pass(complete=self._served >= n, entered=ended)
        self._pass_done()

    def _position_after(self, b: int) -> int:
        """The position once the pass's batch ``b`` was handed over: b + 1, or where the pass's
        batches are not the plan's (``_after``: past skipped steps, the next one to serve; with
        a batch-size schedule, the end of the step's batches)."""
        after = getattr(self, "_after", None)
        return b + 1 if after is None else int(after[b])

    def _pass_done(self) -> None:
        self._start_epoch(self._epoch + 1)

    def _check_ranks_agree(self, plan: RankPlan) -> None:
        """One all-reduce per epoch: every rank has the same dataset, config and batch count.

        Without it, a rank on another dataset version would wait forever in the first
        all-reduce of training after the others ran out of batches.
        """
        if self._checked_epoch == self._epoch or not self._in_process_group():
            return
        self._checked_epoch = self._epoch
        ident = f"{self.fingerprint}/{self.batching.fingerprint()}/{self._epoch}"
        self._agree(
            [plan.batches_per_rank, self._served],
            ident,
            "(batches per rank, dataset/config, position)",
            "Every rank must open the same dataset version with the same batching and state.",
        )

    def _in_process_group(self) -> bool:
        return in_process_group(self.layout.world_size, self.rank)

    def _agree(self, numbers: list[int], ident: str, what: str, fix: str) -> None:
        """LoaderError naming the ranges if any rank differs on ``numbers`` or ``ident``."""
        message = disagreement(self.rank, numbers, ident, what, fix)
        if message is not None:
            raise LoaderError(message)
