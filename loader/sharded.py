"""`ShardedLoader`: the plan of this rank's batches, read by workers, resumable by position."""
from __future__ import annotations

import hashlib
import logging
import os
from typing import Any, Callable, Iterator

import numpy as np

from ..format import ShardtoolError
from ..plan import Batching, EpochPlan, plan_epoch
from ..plan.env import rank_placement
from ..plan.state import LoaderState, check_compatible, plan_for_state
from .collate import unpack_batch
from .observe import Observer
from .reader import BatchReader, describe_ids
from .source import SourceSpec
from .workers import PlanBatches, make_dataloader

log = logging.getLogger(__name__)


class LoaderError(ShardtoolError, RuntimeError):
    """Loading a batch failed (a worker died, hung or raised); names the batch and its shards."""


class LoaderStateError(ShardtoolError, ValueError):
    """A state_dict that cannot be loaded here (other dataset, batching config or version)."""


class ShardedLoader:
    """Batches of a packed dataset for one rank of a (possibly multi-node) training job.

    Exactly one of ``batch_size`` (samples per batch) and ``max_tokens`` (batch size x longest
    length, padding counted) is given. The rank layout comes from the arguments, else an
    initialised torch.distributed (+ LOCAL_WORLD_SIZE), else torchrun's env, else SLURM's, else
    a single process. Every rank yields ``len(loader)`` batches this epoch, known before the
    first batch. ``state_dict()`` describes the batches handed to the training loop so far and
    is identical on every rank; ``load_state_dict`` continues exactly there (on any world size).

    ``set_epoch(e)`` selects epoch ``e``; for the epoch the loader is already in (say, after
    ``load_state_dict``) it keeps the position. After the last batch of an epoch the loader
    moves to the next epoch by itself, and its state says so.

    Observability: ``metrics()`` returns this rank's counters (see there). Every
    ``metrics_every`` steps (0: never) the rank appends one JSON line to a node-local file in
    ``metrics_dir`` (default: ``<cache_dir>/metrics/<run>``, else ``$TMPDIR/shardtool-metrics/<run>``);
    ``shardtool stats`` merges those files. ``metrics_reduce=True`` adds an all-gather across
    ranks at those steps; rank 0 logs min/median/max wait and throughput and the slowest rank.
    A batch not delivered within ``stall_timeout`` seconds (None: no watchdog; independent of
    the workers' ``timeout``) raises `LoaderError` naming the shard, byte offset and tier being
    read, after dumping the stacks of the trainer and every worker next to the metric lines.
    ``metrics=False`` keeps no counters at all (the watchdog still fires, without read details).
    """

    def __init__(self, url: str, *, batch_size: int | None = None, max_tokens: int | None = None,
                 shuffle: bool = True, seed: int = 0, rank: int | None = None, world_size: int | None = None,
                 ranks_per_node: int | None = None, num_workers: int = 2, prefetch_factor: int = 2,
                 pin_memory: bool | None = None, cache_dir: str | None = None,
                 transform: Callable | None = None, collate_fn: Callable | None = None, pad_id: int = 0,
                 storage_options: dict | None = None, timeout: float = 300.0, window: int | None = None,
                 metrics: bool = True, metrics_every: int | None = 100, metrics_dir: str | None = None,
                 metrics_reduce: bool = False, stall_timeout: float | None = 300.0):
        import torch

        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be an int >= 0, found {num_workers!r}")
        if num_workers and (not isinstance(prefetch_factor, int) or prefetch_factor < 1):
            raise ValueError(f"prefetch_factor must be an int >= 1, found {prefetch_factor!r}")
        self.batching = Batching(batch_size=batch_size, max_tokens=max_tokens, shuffle=shuffle, seed=seed,
                                 window=window)
        dist = torch.distributed if torch.distributed.is_available() else None
        self.placement = rank_placement(rank, world_size, ranks_per_node, env=os.environ, dist=dist)
        self.rank, self.layout = self.placement.rank, self.placement.layout
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self.timeout = float(timeout)
        self.transform = transform
        self.collate_fn = collate_fn
        self.pad_id = int(pad_id)
        self.spec = SourceSpec(url, cache_dir, storage_options)
        self.reader = BatchReader(self.spec, pad_id=self.pad_id)
        ds = self.reader.source.dataset  # metadata only: manifest + lengths
        self.dataset = ds
        self.fingerprint = ds.version
        self._lengths = ds.lengths
        self._counts = ds.shard_counts
        self._epoch = 0
        self._state = LoaderState.start(0, self.fingerprint, self.batching, self.layout)
        self._plan: EpochPlan | None = None
        self._served = 0  # batches of the current plan handed to the training loop
        self._pass_start = 0
        self._checked_epoch: int | None = None
        self._obs = Observer(self.reader, self.placement, num_workers=num_workers, prefetch_factor=prefetch_factor,
                             metrics=metrics, metrics_every=metrics_every, metrics_dir=metrics_dir,
                             metrics_reduce=metrics_reduce, cache_dir=cache_dir, stall_timeout=stall_timeout,
                             source_name=url)

    # ------------------------------------------------------------------ epoch and plan
    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, found {epoch!r}")
        if epoch == self._epoch:
            return
        self._start_epoch(epoch)

    def _start_epoch(self, epoch: int) -> None:
        self._epoch = epoch
        self._state = LoaderState.start(epoch, self.fingerprint, self.batching, self.layout)
        self._plan = None
        self._served = self._pass_start = 0

    @property
    def plan(self) -> EpochPlan:
        if self._plan is None:
            self._plan = plan_epoch(self._lengths, self._counts, self.layout, self.batching, self._epoch)
            self._log_plan()
        return self._plan

    def _log_plan(self) -> None:
        p = self._plan
        log.info("epoch %d rank %d/%d: %d batches, padding efficiency %.3f, remainder %d samples",
                 self._epoch, self.rank, self.layout.world_size, p.batches_per_rank, p.padding_efficiency,
                 p.remainder.size)

    @property
    def length_field(self) -> str | None:
        """The field whose padded tensor the default batch carries (the dataset's length field)."""
        return self.dataset.manifest.length.get("field")

    @property
    def remainder(self) -> np.ndarray:
        """Global ids of this epoch's samples that no rank serves (they rotate across epochs)."""
        return self.plan.remainder

    @property
    def padding_efficiency(self) -> float:
        return self.plan.padding_efficiency

    def __len__(self) -> int:
        """Batches the current pass yields: the whole epoch, or what remains of it after a resume."""
        return self.plan.batches_per_rank - self._pass_start

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Position after the last batch handed out: small, JSON-ready, equal on every rank, no I/O."""
        plan = self.plan
        if self._served >= plan.batches_per_rank:
            return LoaderState.start(self._epoch + 1, self.fingerprint, self.batching, self.layout).to_dict()
        return self._state.with_served(self._served).to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            st = LoaderState.from_dict(state)
            check_compatible(st, self.fingerprint, self.batching)
            plan, start = plan_for_state(self._lengths, self._counts, self.layout, self.batching, st)
        except ValueError as e:
            raise LoaderStateError(f"cannot load this loader state: {e}") from None
        self._epoch = st.epoch
        self._state = st.resumed_on(self.layout)
        self._plan = plan
        self._served = self._pass_start = start
        self._log_plan()

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[Any]:
        plan = self.plan
        n = plan.batches_per_rank
        self._pass_start = start = self._served
        self._check_ranks_agree(plan)
        first = plan._first(self.rank)
        where = f"rank {self.rank}/{self.layout.world_size}, epoch {self._epoch}"
        # This rank's n batches: absolute offsets into the plan's ids (n + 1 of them, [0] when n == 0).
        batches = PlanBatches(self.reader, plan.sample_ids, plan.batch_offsets[first : first + n + 1],
                              where=where, transform=self.transform, collate_fn=self.collate_fn, pad_id=self.pad_id)
        return self._run(batches, start, n, where)

    def _run(self, batches: PlanBatches, start: int, n: int, where: str) -> Iterator[Any]:
        watch = self._obs.begin_pass(batches, start, n, where, self._epoch)  # before the workers fork
        try:
            dl = make_dataloader(batches, start, num_workers=self.num_workers, prefetch_factor=self.prefetch_factor,
                                 pin_memory=self.pin_memory, timeout=self.timeout, worker_init=self._obs.worker_init)
        except BaseException:
            self._obs.end_pass(complete=False)
            raise
        it = iter(dl)
        try:
            for b in range(start, n):
                try:
                    batch = watch.next(it, b)
                except StopIteration:
                    raise LoaderError(f"{where}: the reader stopped after {b} of {n} batches") from None
                except ShardtoolError:
                    raise  # our reader's errors already name the shard and sample
                except (RuntimeError, EOFError, ConnectionError) as e:
                    # The worker pool's own failures: a worker killed, exited or timed out (a
                    # worker killed mid-send can also surface as a broken pipe: EOF, reset).
                    raise LoaderError(
                        f"{where}: batch {b} could not be loaded ({describe_ids(self.reader, batches.batch_ids(b))}): "
                        f"a worker process failed, exited or was killed ({type(e).__name__}: {e})"
                    ) from e
                self._served = b + 1
                yield unpack_batch(batch)
        finally:
            it.close()  # the worker pool, or the in-process generator
            self._obs.end_pass(complete=self._served >= n)
        self._start_epoch(self._epoch + 1)

    def _check_ranks_agree(self, plan: EpochPlan) -> None:
        """One all-reduce per epoch: every rank has the same dataset, config and batch count.

        Without it, a rank on another dataset version would wait forever in the first
        all-reduce of training after the others ran out of batches.
        """
        import torch
        import torch.distributed as dist

        if self._checked_epoch == self._epoch or not (dist.is_available() and dist.is_initialized()):
            return
        if dist.get_world_size() != self.layout.world_size or dist.get_rank() != self.rank:
            return  # an explicit layout that is not the process group's: nothing to compare with
        self._checked_epoch = self._epoch
        ident = f"{self.fingerprint}/{self.batching.fingerprint()}/{self._epoch}".encode()
        digest = int(hashlib.sha256(ident).hexdigest()[:15], 16)
        mine = [plan.batches_per_rank, digest, self._served]
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        t = torch.tensor(mine + [-x for x in mine], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        hi, neg_lo = t[:3].tolist(), t[3:].tolist()
        if any(h != -lo for h, lo in zip(hi, neg_lo)):
            raise LoaderError(
                f"rank {self.rank}: ranks disagree on (batches per rank, dataset/config, position): "
                f"this rank has {mine}; ranges across ranks {list(zip([-x for x in neg_lo], hi))}. "
                "Every rank must open the same dataset version with the same batching and state."
            )

    # ------------------------------------------------------------------ observability
    def metrics(self) -> dict[str, Any]:
        """This rank's loader metrics as a plain dict, cheap enough to call every step.

        ``cumulative``: since the first batch was asked for; ``window``: since the previous call.
        Each has the time the training loop waited in ``next()`` (``wait_s``, ``wait_fraction``),
        the time workers spent producing batches, samples/tokens per second and padding
        efficiency (tokens from the index lengths), bytes read per tier (node ``cache``, ``local``
        files read in place, ``remote``: ranged reads plus whole shards fetched on a cache miss),
        cache hits/misses/fetched bytes, shard opens with p50/p99 open latency, tokens per source,
        and worker starts/restarts. ``cache_behind_shards``: shards of the next batches that are
        neither cached nor being fetched, at the last check. Workers read ahead and publish their
        byte counts every few batches, so their counters may lead or trail the batches handed over
        by a few; at the end of a pass they are exact.
        """
        return self._obs.metrics(self._epoch, self._served)

    @property
    def metrics_path(self) -> str:
        """This rank's JSONL file of metric lines (one per ``metrics_every`` steps; node-local by default)."""
        return self._obs.file.path

    @property
    def rank_summary(self) -> dict | None:
        """The last cross-rank summary (``metrics_reduce=True``): min/median/max, the slowest rank."""
        return self._obs.rank_summary

    def close(self) -> None:
        self._obs.close()
        self.reader.close()
