"""What `ShardedLoader.metrics()` returns: the trainer's counters plus every worker's, as plain dicts.

The trainer counts what only it sees — time spent inside ``next()``, batches handed over,
their samples and tokens (from the index lengths, looked up per pass, not per step) — and reads
the reading processes' counters from the shared `Table` (observability/probe.py). A `Snapshot` is one
flat vector of all of it, so a window ("since the last call") is the difference of two snapshots
and costs the same as the cumulative view: a few microseconds, cheap enough for every step.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from . import probe as P

# Trainer-side entries of a snapshot, then the table's columns.
T_TIME, T_WAIT, T_BATCHES, T_SAMPLES, T_TOKENS, T_PADDED, T_STARTS, T_RESTARTS = range(8)
TRAINER = 8

# A mixture's per-step counts: step -> (samples, tokens, padded, real tokens per source).
StepStats = Callable[[int], tuple[int, int, int, dict[str, int]]]


class Snapshot:
    __slots__ = ("v",)

    def __init__(self, v: np.ndarray):
        self.v = v


class Meter:
    """Trainer-side counters of one loader, and the reading processes' table."""

    def __init__(self, table: P.Table, source_names: list[str], in_process: bool = False):
        self.table = table
        self.source_names = list(source_names)
        # A mixture's tokens per source (`count_step`); one dataset's are all its tokens.
        self.source_tokens = [0] * len(self.source_names) if len(self.source_names) > 1 else []
        self.per_step: StepStats | None = None  # a mixture's (`start_steps`)
        # num_workers=0: batches are produced inside next(), so producing them is the wait.
        self.in_process = in_process
        # Plain attributes: adding to one costs a fraction of a numpy scalar store, every step.
        self.wait_s = 0.0
        self.steps = self.samples = self.tokens = self.padded = self.worker_starts = self.worker_restarts = 0
        self.began: float | None = None  # first request for a batch: where cumulative time starts
        self.batch_samples = self.batch_tokens = self.batch_padded = ()

    # ------------------------------------------------------------------ per pass / per step
    def start_pass(
        self,
        samples: np.ndarray,
        tokens: np.ndarray,
        padded: np.ndarray,
        workers: int,
        restart: bool,
        entered: float | None = None,
    ) -> None:
        """Per-batch samples, tokens and padded tokens of this pass's plan (`PlanBatches.stats`, through `PlanBatches.start_meter`);
        ``entered``: when the first ``next()`` of the pass was called (default: now)."""
        if self.began is None:
            # From the first next()'s entry, which wait_s counts from: wait_s <= seconds.
            self.began = time.perf_counter() if entered is None else entered
        self.worker_starts += workers
        if restart:
            self.worker_restarts += workers
        # Lists: indexing one is several times cheaper per step than indexing a numpy array
        # (`Pass.next` adds them up as batches are handed over).
        self.batch_samples, self.batch_tokens, self.batch_padded = samples.tolist(), tokens.tolist(), padded.tolist()
        self.per_step = None

    def start_steps(self, per_step: StepStats, workers: int, restart: bool, entered: float | None = None) -> None:
        """A mixture's pass: its steps' counts come from ``per_step(b)`` as each is handed over
        (a mixture runs for millions of steps; its per-step plan is a closed form, not a table)."""
        none = np.zeros(0, dtype=np.int64)
        self.start_pass(none, none, none, workers, restart, entered)
        self.per_step = per_step

    def count_step(self, b: int) -> None:
        per_step = self.per_step
        if per_step is None:
            raise RuntimeError("shardtool internal error: called only on a mixture's pass (`Pass.next`), which set it")
        samples, tokens, padded, by_source = per_step(b)
        self.samples += samples
        self.tokens += tokens
        self.padded += padded
        if self.source_tokens:  # one source keeps no counter of its own: its tokens are the total
            for i, name in enumerate(self.source_names):
                self.source_tokens[i] += by_source.get(name, 0)

    # ------------------------------------------------------------------ reporting
    def snapshot(self) -> Snapshot:
        now = time.perf_counter()
        t = np.array(
            [
                now - (self.began if self.began is not None else now),
                self.wait_s,
                self.steps,
                self.samples,
                self.tokens,
                self.padded,
                self.worker_starts,
                self.worker_restarts,
                *self.source_tokens,
            ],
            dtype=np.float64,
        )
        return Snapshot(np.concatenate([t, self.table.totals()]))

    def section(self, now: Snapshot, since: Snapshot | None = None) -> dict:
        """The counters between ``since`` (None: the start) and ``now``, as a plain dict."""
        d = now.v - since.v if since is not None else now.v
        # One conversion to Python numbers: per-element numpy access would cost more than the rest.
        k = TRAINER + len(self.source_tokens)
        t, c = d[:TRAINER].tolist(), d[k : k + P.HIST0].tolist()
        by_source = d[TRAINER:k].tolist()
        seconds, wait = t[T_TIME], t[T_WAIT]
        samples, tokens, padded = int(t[T_SAMPLES]), int(t[T_TOKENS]), int(t[T_PADDED])
        hits, misses = int(c[P.HITS]), int(c[P.MISSES])
        p50 = p99 = None
        if c[P.OPENS]:
            p50, p99 = P.percentiles(d[k + P.HIST0 :], (0.50, 0.99))
        return {
            "seconds": seconds,
            "batches": int(t[T_BATCHES]),
            "samples": samples,
            "tokens": tokens,
            "padded_tokens": padded,
            "wait_s": wait,
            "wait_fraction": _ratio(wait, seconds),
            "samples_per_s": _ratio(samples, seconds),
            "tokens_per_s": _ratio(tokens, seconds),
            "padding_efficiency": _ratio(tokens, padded),
            "tokens_by_source": (
                {n: int(v) for n, v in zip(self.source_names, by_source)}
                if by_source
                else {self.source_names[0]: tokens}
            ),
            "worker_starts": int(t[T_STARTS]),
            "worker_restarts": int(t[T_RESTARTS]),
            "produce_s": wait if self.in_process else c[P.PRODUCE_S],
            "batches_produced": int(t[T_BATCHES] if self.in_process else c[P.BATCHES]),
            "bytes_read": {
                "cache": int(c[P.BYTES_CACHE]),
                "local": int(c[P.BYTES_LOCAL]),
                "remote": int(c[P.BYTES_REMOTE]),
            },
            "cache": {
                "hits": hits,
                "misses": misses,
                "hit_rate": _ratio(hits, hits + misses),
                "fetch_bytes": int(c[P.FETCH_BYTES]),
            },
            "shard_opens": int(c[P.OPENS]),
            "shard_open_p50_s": p50,
            "shard_open_p99_s": p99,
        }


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None
