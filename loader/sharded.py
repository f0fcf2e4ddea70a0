"""`ShardedLoader`: the plan of this rank's batches, read by workers, resumable by position."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from ..plan import Planner, RankPlan, data_parallel
from ..plan.about import describe
from ..plan.batching import default_bucketing
from ..plan.env import rank_placement
from ..plan.mesh import as_mesh
from ..plan.packing import with_packed_eos
from ..plan.schedule import StepClock, with_runs
from ..plan.state import LoaderState, StateError, check_compatible
from . import tokenfields
from .errors import LoaderStateError
from .imagerows import ImageSpec
from .imagerows import of_dataset as images_of
from .observability.observe import Observer
from .options import batch_options, worker_options
from .passrun import PassRunner
from .reader import BatchReader
from .source import SourceSpec
from .workers import PlanBatches

log = logging.getLogger(__name__)


class ShardedLoader(PassRunner):
    """Batches of a packed dataset for one rank of a (possibly multi-node) training job.

    Every rank yields ``len(loader)`` batches an epoch, known before the first batch and equal on
    every rank; ``state_dict()`` is the position after the batches handed out (small, JSON, equal
    on every rank) and ``load_state_dict`` continues exactly there, on any number of ranks. Every
    decision is a pure plan from the dataset's metadata, the seed and the layout
    (docs/plan.md). The default batch pads the length field (``LongTensor [B, L]`` and
    ``lengths``) and stacks the others as ``default_collate`` would; packed rows carry
    ``input_ids``, ``labels``, ``position_ids``, ``cu_seqlens``... (docs/sequence-packing.md).

    Args:
        url: The dataset (a path or any fsspec URL), or a `shardtool.plan.mixture.Mixture` of
            several read by token weights (give ``steps`` or ``tokens``; docs/mixtures.md).
        batch_size: Samples per batch, or rows per batch with ``seq_len``; or a schedule by the
            run's step, ``{0: 4, 2000: 8}`` (planned at the sizes' gcd; docs/run-changes.md).
        max_tokens: Instead of ``batch_size``: batch size x longest length, padding counted.
        shuffle: Shuffle each epoch (False: each data group's range in dataset order).
        seed: The shuffle's seed; the same seed gives the same batches.
        bucketing: Sort by length within shuffle windows to cut padding. Default: on with
            ``shuffle`` where the dataset's length counts what a batch pads, off for byte sizes.
        rank, world_size, ranks_per_node: The layout; default: torch.distributed, else torchrun's
            or SLURM's environment, else one process.
        dp_rank, dp_size, mesh, dp_dim: Who is data-parallel under TP/PP/CP: a torch DeviceMesh (or
            `shardtool.plan.Mesh`) and its DP dimension name(s), or the DP size and rank. Ranks of
            one DP rank get byte-identical batches.
        seq_len: Pack documents into rows of exactly this many tokens (sequence packing).
        packing: ``"best-fit"``, ``"concat"``, ``"no-split"`` or ``"stream"`` (docs/sequence-packing.md).
        eos_id: Appended to each packed document (not where the pack stored one).
        max_docs_per_row: The most pieces in a packed row (sizes ``cu_seqlens``).
        num_workers, prefetch_factor, pin_memory, timeout: Worker processes and their prefetch,
            as torch's DataLoader (``pin_memory=None``: where CUDA is available).
        cache_dir: The node cache: shards read from local disk, fetched on a miss (docs/slurm.md).
        transform: Per sample, in the workers, before collation (not with ``seq_len``).
        collate_fn: Replaces the default collation of a batch's samples (not with ``seq_len``).
        pad_id: What pads the length field or packed rows.
        storage_options: For fsspec (credentials, an S3 endpoint).
        window: Samples sorted together by length (default: 256 batches' worth).
        metrics, metrics_every, metrics_dir, metrics_reduce: Counters, a JSON line every
            ``metrics_every`` steps under ``metrics_dir`` (``shardtool stats`` merges them), and an
            all-gather across ranks at those steps (docs/observability.md).
        stall_timeout: A batch not delivered within it raises `LoaderError` naming the shard,
            offset and tier being read, after dumping every process's stacks (None: no watchdog).
        steps, tokens: A mixture's length.
        drop_last: False serves every sample on any number of DP ranks (ranks short of batches
            split some); True may leave out a rotating surplus of at most 0.2% of the tokens.
        stage: In-job staging into ``cache_dir`` (True, ``"external"``; default SHARDTOOL_STAGE).
        packed_outputs: ``"full"``, or ``"lean"``: only what the GPU cannot derive
            (`shardtool.loader.packed.lean_to_full` adds labels and positions there).
        cost_model, balance_window, micro_batches: Steps of equal compute on every DP rank
            (a model shape, measured ``{"a", "b"}`` or a preset such as ``"llama-7b"``), balanced
            in blocks of ``balance_window`` steps, over ``micro_batches`` accumulated batches.
        shuffle_block: Shuffle blocks of this many neighbouring samples, the blocks in random
            order: a weaker shuffle that reads a shard or two at once.
        exact: Serve every sample exactly once on any number of ranks (evaluation); padding
            batches and rows are marked in ``batch["valid"]`` (`shardtool.loader.ValidSum`).
        token_fields: The per-token array fields packed rows carry (default: every array field).
        image_transform: Applied in the workers to each image of an image-text dataset's rows.

    Raises:
        ValueError: Options that contradict each other or the dataset, naming them.
        FormatError: A dataset that cannot be read, naming the file.
        LoaderError: A batch that cannot be read or is not delivered in time, naming the shard.

    ``len(loader)`` counts the epoch's batches from its first, also after a resume (as Lightning
    counts); ``batches_left`` is what the next pass yields. After the last batch of an epoch the
    loader is in the next one: resume with ``start_epoch = loader.epoch``. ``set_epoch`` to an
    epoch before a loaded state's is refused (it would replay it).
    """

    # Another kind of ``url`` is read by a subclass that says so when it is defined (loader/mixed.py:
    # ``class MixtureLoader(ShardedLoader, serves=Mixture)``), and ``ShardedLoader(url)`` builds
    # that subclass; this module never imports its subclasses (imports go one way: mixed -> sharded).
    # ``shardtool.loader.ShardedLoader`` imports loader/mixed.py before handing out the class.
    _served_by: dict[type, type] = {}

    def __init_subclass__(cls, serves: type | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if serves is not None:
            ShardedLoader._served_by[serves] = cls

    def __new__(cls, url: Any = None, *args: Any, **kwargs: Any) -> ShardedLoader:
        if cls is ShardedLoader:
            for kind, subclass in ShardedLoader._served_by.items():
                if isinstance(url, kind):  # a Mixture: the mixture's own iteration and state
                    return super().__new__(subclass)
            from ..plan.mixture import Mixture

            if isinstance(url, Mixture):  # only when loader/mixed.py was never imported
                raise TypeError(
                    "a Mixture is read by the ShardedLoader of shardtool.loader (from shardtool.loader "
                    "import ShardedLoader), which knows mixtures; shardtool.loader.sharded alone does not"
                )
        return super().__new__(cls)

    def __init__(
        self,
        url: Any,
        *,
        batch_size: int | None = None,
        max_tokens: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        bucketing: bool | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        ranks_per_node: int | None = None,
        dp_rank: int | None = None,
        dp_size: int | None = None,
        mesh: Any = None,
        dp_dim: str | tuple[str, ...] = "dp",
        seq_len: int | None = None,
        packing: str = "best-fit",
        eos_id: int | None = None,
        max_docs_per_row: int | None = None,
        num_workers: int = 2,
        prefetch_factor: int = 2,
        pin_memory: bool | None = None,
        cache_dir: str | None = None,
        transform: Callable | None = None,
        collate_fn: Callable | None = None,
        pad_id: int = 0,
        storage_options: dict | None = None,
        timeout: float = 300.0,
        window: int | None = None,
        metrics: bool = True,
        metrics_every: int | None = 100,
        metrics_dir: str | None = None,
        metrics_reduce: bool = False,
        stall_timeout: float | None = 300.0,
        steps: int | None = None,
        tokens: int | None = None,
        drop_last: bool | None = None,
        stage: bool | str | None = None,
        packed_outputs: str = "full",
        cost_model: Any = None,
        balance_window: int | None = None,
        micro_batches: int | None = None,
        shuffle_block: int | None = None,
        exact: bool = False,
        token_fields: Sequence[str] | None = None,
        image_transform: Callable[[bytes], Any] | None = None,
    ):
        import torch

        work = worker_options(num_workers, prefetch_factor, pin_memory, timeout)
        opts = batch_options(
            batch_size=batch_size,
            max_tokens=max_tokens,
            shuffle=shuffle,
            seed=seed,
            window=window,
            bucketing=bucketing,
            seq_len=seq_len,
            packing=packing,
            eos_id=eos_id,
            max_docs_per_row=max_docs_per_row,
            packed_outputs=packed_outputs,
            drop_last=drop_last,
            cost_model=cost_model,
            balance_window=balance_window,
            micro_batches=micro_batches,
            shuffle_block=shuffle_block,
            exact=exact,
            transform=transform,
            collate_fn=collate_fn,
            pad_id=pad_id,
            token_fields=token_fields,
        )
        self.batching, self.packing, self.packed_outputs = opts.batching, opts.packing, opts.packed_outputs
        self.schedule = opts.schedule  # batch_size by step: the plan is made at its base size
        if self.schedule is not None and type(self) is not ShardedLoader:
            raise ValueError("batch_size by step (a schedule) is not supported for a Mixture yet; give one size")
        self.transform, self.collate_fn, self.pad_id = opts.transform, opts.collate_fn, opts.pad_id
        self._bucketing = bucketing
        self._token_fields_wanted = opts.token_fields
        self.token_fields: tuple[str, ...] = ()  # per-token fields packed batches carry (set by _open)
        if image_transform is not None and seq_len is None:
            raise ValueError("image_transform applies to the images of packed rows (seq_len); use transform otherwise")
        self.image_transform = image_transform
        self.images: ImageSpec | None = None  # an image-text dataset's images, packed (set by _open)
        dist = torch.distributed if torch.distributed.is_available() else None
        self.placement = rank_placement(rank, world_size, ranks_per_node, env=os.environ, dist=dist)
        self.rank, self.layout = self.placement.rank, self.placement.layout
        self.data_layout, self.dp_rank = data_parallel(
            self.placement, dp_rank=dp_rank, dp_size=dp_size, mesh=as_mesh(mesh), dp_dims=_dp_dims(dp_dim)
        )
        self.num_workers, self.prefetch_factor = work.num_workers, work.prefetch_factor
        self.pin_memory, self.timeout = work.pin_memory, work.timeout
        self._open(url, cache_dir=cache_dir, storage_options=storage_options, steps=steps, tokens=tokens)
        try:
            self._obs = Observer(
                self._readers(),
                self.placement,
                num_workers=num_workers,
                prefetch_factor=prefetch_factor,
                metrics=metrics,
                metrics_every=metrics_every,
                metrics_dir=metrics_dir,
                metrics_reduce=metrics_reduce,
                cache_dir=cache_dir,
                stall_timeout=stall_timeout,
            )
            self._obs.micro = self.batching.micro_batches or 1
            from .staging import staging_for  # lazy: imports the cache, as a loader with a cache_dir does

            one = type(self) is ShardedLoader
            source = self.reader.source if one else None
            self._staging = staging_for(source, self.placement, stage, cache_dir, one_dataset=one)
            # No "cache behind the plan" warning while staging: the stager keeps it a bounded distance ahead.
            self._obs.staged = self._staging is not None
        except BaseException:
            self.close()
            raise

    def _open(
        self, url: str, *, cache_dir: str | None, storage_options: dict | None, steps: int | None, tokens: int | None
    ) -> None:
        """The dataset and its plan (a `Mixture` opens its sources instead: loader/mixed.py)."""
        if steps is not None or tokens is not None:
            raise ValueError(
                "steps= and tokens= give the length of a Mixture; a single dataset is read by epochs "
                "(len(loader) batches each, set_epoch to choose one)"
            )
        self.spec = SourceSpec(url, cache_dir, storage_options)
        self.reader = BatchReader(self.spec, pad_id=self.pad_id)
        ds = self.reader.source.dataset  # metadata only: manifest, summaries, this rank's range's lengths
        self.dataset = ds
        try:
            self._no_double_eos({str(url): ds.manifest.length.get("eos_id")})
        except ValueError:
            self.reader.close()
            raise
        if self.packing is not None:
            try:
                self.token_fields = tokenfields.of_dataset(ds, self._token_fields_wanted)
                self.images = images_of(ds, self.packing.policy)
                if self.image_transform is not None and self.images is None:
                    raise ValueError(
                        "image_transform is for image-text datasets (pack --image-field); this has no images"
                    )
            except ValueError as e:
                self.reader.close()
                raise ValueError(f"{url}: {e}") from None
        self.fingerprint = ds.version
        if self._bucketing is None:  # the dataset decides (see the class docstring); the plan stays pure
            self.batching = replace(
                self.batching, bucketing=default_bucketing(ds.manifest.length, self.batching.shuffle)
            )
        self.batching = with_runs(self.batching, self.schedule)  # a step joins batches: runs of like lengths
        self.planner = Planner(ds, self.batching)
        self._epoch = 0
        self._state = self.planner.start(0, self.fingerprint, self.data_layout)  # ValueError: cannot plan
        self._first_step = 0  # the run's step at the epoch's first batch (a batch-size schedule's steps)
        self._plan: RankPlan | None = None
        self._served = 0  # batches of the current plan handed to the training loop
        self._checked_epoch: int | None = None
        self._loaded_epoch: int | None = None  # a loaded state's epoch, until the loader is iterated

    def _no_double_eos(self, packed_eos: dict[str, int | None]) -> None:
        """Documents packed with --eos-id already end with it: the loader does not add another."""
        packing = with_packed_eos(self.packing, packed_eos)
        if packing is not self.packing:
            log.info(
                "documents already end with EOS id %d (packed with --eos-id): the loader appends none",
                self.packing.eos_id,
            )
            self.packing = packing
            self.batching = replace(self.batching, packing=packing)

    def _readers(self) -> dict[str, BatchReader]:
        """The readers the metrics count, by source name (one dataset: its URL)."""
        return {str(self.spec.url): self.reader}

    # ------------------------------------------------------------------ epoch and plan
    @property
    def epoch(self) -> int:
        self._settle()
        return self._epoch

    def _settle(self) -> None:
        """Once every batch of the epoch was handed over, the loader is in the next epoch, whether
        or not the consumer asked for one more batch and saw StopIteration: a trainer that stops
        after len(loader) batches (Lightning does) gets the next epoch from its next iter()."""
        if self._at_epoch_end():
            self._close_pass()
            self._pass_done()

    def _at_epoch_end(self) -> bool:
        return self._plan is not None and bool(self._served) and self._served >= self._plan.batches_per_rank

    def set_epoch(self, epoch: int) -> None:
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, found {epoch!r}")
        self._settle()
        if epoch == self._epoch:
            return
        if self._loaded_epoch is not None and epoch < self._loaded_epoch:
            # Refused, not warned: the replay would be silent in the loss curve, cost a whole
            # epoch and break "no sample repeated"; the fix is one line, and it fails before step 1.
            raise LoaderStateError(
                f"set_epoch({epoch}) after load_state_dict would go back from the loaded position in epoch "
                f"{self._loaded_epoch} and serve epoch {epoch} again from its start. A state saved after the "
                f"last batch of an epoch is the start of the next one. Resume with start_epoch = loader.epoch "
                f"(after load_state_dict), not the epoch counter saved beside the state; to start over at an "
                f"earlier epoch, do not load the state."
            )
        self._start_epoch(epoch)

    def _start_epoch(self, epoch: int) -> None:
        if self.schedule is not None:
            # The epoch after this one begins where this one's steps end; any other begins where
            # whole epochs on this layout would have brought the run (as a fresh run counts).
            following = epoch == self._epoch + 1 and self._plan is not None
            self._first_step = self._first_step + self._steps()[1] if following else self._steps_before(epoch)
        self._epoch = epoch
        self._state = self.planner.start(epoch, self.fingerprint, self.data_layout)
        self._plan = None
        self._served = 0

    # ------------------------------------------------------------------ batch-size schedule
    def step_clock(self, epoch: int | None = None) -> StepClock | None:
        """The batch-size schedule's steps over ``epoch`` (default: the current one, from where
        the loader's state says it began; another one as if every epoch before it ran whole on
        this layout); None without a schedule. `shardtool.loader.trace` maps steps with it."""
        if self.schedule is None:
            return None
        first = self._first_step if epoch is None or epoch == self._epoch else self._steps_before(epoch)
        return StepClock(self.schedule, first)

    def _steps(self) -> tuple[int, int]:
        """(steps handed over, steps) of the current epoch: batches, or with a batch-size
        schedule the steps they make from the epoch's first step (`shardtool.plan.schedule`)."""
        state = self._state.with_served(self._served)
        clock = self.step_clock()
        if clock is None:
            earlier = sum(s.delivered for s in state.segments[:-1])
            return earlier + state.last.delivered, earlier + state.last.steps
        return clock.steps(state)

    def _steps_before(self, epoch: int) -> int:
        """The run's step at ``epoch``'s first batch when every epoch before it ran whole on this
        layout (a plan's count is the same every epoch)."""
        batches = self.planner.start(0, self.fingerprint, self.data_layout).last.batches
        return self.schedule.epoch_first_step(epoch, batches)

    @property
    def plan(self) -> RankPlan:
        """This rank's batches in the current epoch (segment): planned from its own group's range."""
        if self._plan is None:
            self._plan = self.planner.rank_plan(self._state, self.dp_rank)
            self._log_plan()
        return self._plan

    def _log_plan(self) -> None:
        p = self._plan
        left = (
            f"remainder {p.remainder.size} samples, {p.remainder_pieces} pieces, {p.remainder_tokens} tokens of its group"
            if p.remainder is not None
            else f"{p.leftover_batches} batches left over by the resume's re-deal"
        )
        log.info(
            "epoch %d rank %d/%d (DP rank %d of %d): %d batches, padding efficiency %.3f, %s",
            self._epoch,
            self.rank,
            self.layout.world_size,
            self.dp_rank,
            self.data_layout.dp_size,
            p.batches_per_rank,
            p.padding_efficiency,
            left,
        )

    @property
    def length_field(self) -> str | None:
        """The field whose padded tensor the default batch carries (the dataset's length field)."""
        return self.dataset.manifest.length.get("field")

    @property
    def remainder(self) -> np.ndarray:
        """Global ids of the samples of this rank's data group that no rank serves this epoch (they
        rotate across epochs). After an elastic resume, the epoch's rest is re-dealt whole batches:
        nothing more is left out but ``plan.leftover_batches``, and this is empty."""
        rem = self.plan.remainder
        return rem if rem is not None else np.zeros(0, np.int64)

    @property
    def remainder_tokens(self) -> int:
        """Tokens of this rank's data group that no rank serves this epoch: with packing, of the
        pieces left out for equal counts (eos counted), which `remainder` (documents no token of
        which is served) does not show. 0 with drop_last=False, and after an elastic resume."""
        got = self.plan.remainder_tokens
        return int(got) if got is not None else 0

    @property
    def remainder_pieces(self) -> int:
        """Pieces of documents (packed) or samples that make up `remainder_tokens`."""
        got = self.plan.remainder_pieces
        return int(got) if got is not None else 0

    @property
    def padding_efficiency(self) -> float:
        """Real tokens / tokens of the padded batches: bucketed batches, or packed rows (fill rate)."""
        return self.plan.fill_rate if self.packing is not None else self.plan.padding_efficiency

    def __len__(self) -> int:
        """This rank's batches in the current epoch, counted from its first batch, after a resume
        too (as torchdata's StatefulDataLoader counts): a trainer restores its own count of the
        batches done and ends the epoch when it reaches ``len()`` (Lightning does). After an
        elastic resume: the batches served on the earlier layout(s) plus this layout's share of
        the rest. `batches_left` is what the next pass yields. Once every batch of an epoch was
        handed over, the next epoch's (a trainer reads it there to size that epoch)."""
        self._settle()
        self.plan  # noqa: B018 - the current segment is planned
        return self._steps()[1]

    @property
    def batches_left(self) -> int:
        """Batches the next pass yields: ``len(loader)`` from an epoch's start, less after a resume."""
        self._settle()
        self.plan  # noqa: B018 - the current segment is planned
        if self.schedule is not None:
            done, total = self._steps()
            return total - done
        return self._state.with_served(self._served).last.left

    @property
    def resuming(self) -> bool:
        """A state was loaded and no batch has been asked for since (adapters check who restored it)."""
        return self._loaded_epoch is not None

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Position after the last batch handed out: small, JSON-ready, equal on every rank, no I/O."""
        plan = self.plan
        if self._served >= plan.batches_per_rank:
            state = self.planner.start(self._epoch + 1, self.fingerprint, self.data_layout)
            if self.schedule is not None:
                state.step = self._first_step + self._steps()[1]
        else:
            state = self._state.with_served(self._served)
            if self.schedule is not None:
                state.step = self._first_step
        return state.described(self._about()).to_dict()

    def _about(self) -> dict[str, Any]:
        """What this loader's states are saved for, in words: dataset URL and version, batching."""
        return describe(str(self.spec.url), self.dataset.version, len(self.dataset), self.batching)

    def skip_steps(self, first: int, stop: int) -> None:
        """Never serve the batches of this epoch's steps ``first .. stop - 1`` (steps as
        ``len(loader)`` counts them): after ``load_state_dict`` from a checkpoint before a loss
        spike, before the first batch. The steps go on counting and the data moves past them:
        step ``first`` gets the batch of step ``stop``, and the epoch has ``stop - first`` fewer.
        The skip is recorded in `state_dict` (so a later resume, elastic or not, keeps it, and
        `shardtool trace` answers for the run as it went). Every rank must skip the same steps."""
        self._settle()
        self._before_first_batch("skip_steps")
        try:
            state = self._state.with_served(self._served)
            clock = self.step_clock()
            if clock is not None:  # the steps' planned batches, as the state counts them
                first, stop = clock.batches(state, first, stop)
            state = state.skipping(first, stop)
        except StateError as e:
            raise ValueError(f"cannot skip steps {first}:{stop}: {e}") from None
        self._state, self._served = state, state.last.served
        log.info(
            "epoch %d: skipping steps %d..%d (%d batches a rank never served); the epoch now has %d steps",
            self._epoch,
            first,
            stop - 1,
            stop - first,
            len(self),
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where ``state`` (from `state_dict`, on any rank) was: on the same data
        layout from the next batch; on another one (DP size changed) with the epoch's unserved
        batches dealt over the new DP ranks. Refuses a state of another dataset or config."""
        if isinstance(state, dict) and state.get("kind") == "mixture":
            raise LoaderStateError(
                "cannot load this loader state: it was saved by a loader of a Mixture; load it "
                "into ShardedLoader(Mixture(...)) of those sources"
            )
        try:
            st = LoaderState.from_dict(state, batching=self.batching)
            check_compatible(st, self.fingerprint, self.batching, self._about())
            self.planner.check(st)
            resumed = self.planner.continue_on(st, self.data_layout)
            plan = self.planner.rank_plan(resumed, self.dp_rank)
        except ValueError as e:  # StateError, and a plan that cannot be made for it
            raise LoaderStateError(f"cannot load this loader state: {e}") from None
        start = resumed.last.served
        self._epoch = self._loaded_epoch = st.epoch
        if self.schedule is not None:
            self._first_step = st.step if st.step is not None else self._steps_before(st.epoch)
        self._state = resumed
        self._plan = plan
        self._served = start
        self._log_plan()

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
        if self._at_epoch_end():  # a loaded state at the end of an epoch is the next one's start
            self._pass_done()
        yield from self._run(*self._begin_pass())

    def _begin_pass(self) -> tuple[Any, int, int, str]:
        """The pass from the current position: (its batches, first batch, batches, where)."""
        plan = self.plan
        n = plan.batches_per_rank
        self._loaded_epoch = None  # the resume took effect: going back from here on is deliberate
        start = self._served
        self._check_ranks_agree(plan)
        if getattr(self, "_staging", None) is not None:
            self._staging.begin_pass(self._epoch, plan, start)
        self._after = None  # the position after each of the pass's batches, where it is not b + 1
        segment = self._state.with_served(start).last
        rows_per_batch: Any = self.batching.batch_size
        if segment.skipped or self.schedule is not None:
            # The positions still to serve, in order (past skipped steps); with a schedule, each
            # step takes the next size(step) / base of them.
            positions = segment.unserved()
            bounds = np.arange(positions.size + 1, dtype=np.int64)
            if self.schedule is not None:
                step = self._first_step + self._steps()[0]
                bounds = self.schedule.cut(step, int(positions.size))
                sizes = [self.schedule.size_at(step + j) for j in range(bounds.size - 1)]
                rows_per_batch = np.array(sizes, np.int64)
            plan = plan.taking(positions) if segment.skipped else plan
            if self.schedule is not None:
                plan = plan.grouped(bounds if segment.skipped else start + bounds)
            self._after = segment.after(positions[bounds[1:] - 1]) if positions.size else np.zeros(0, np.int64)
            start, n = 0, int(bounds.size - 1)
        where = f"rank {self.rank}/{self.layout.world_size}, epoch {self._epoch}"
        packed = None
        if self.packing is not None:
            from .packed import PackedReader

            packed = PackedReader(
                self.reader,
                self.packing,
                name="input_ids",
                pad_id=self.pad_id,
                rows_per_batch=self.batching.batch_size,
                outputs=self.packed_outputs,
                token_fields=self.token_fields,
                images=self.images,
                image_transform=self.image_transform,
            )
        scheduled = self.schedule is not None
        batches = PlanBatches(
            self.reader,
            plan.ids,
            plan.offsets,
            where=where,
            transform=self.transform,
            collate_fn=self.collate_fn,
            pad_id=self.pad_id,
            lengths=plan.lengths,
            packed=packed,
            packed_rows=plan.batch_rows if packed is not None else None,
            packed_stats=plan.packed_stats(rows_per_batch) if packed is not None else None,
            # Lean chunks lay out batches of one size; a schedule's steps are read one by one.
            packed_pass=(plan.rows, plan.row_offsets) if packed is not None and not scheduled else None,
            rows_per_batch=rows_per_batch if packed is not None and scheduled else None,
            costs=self._costs(plan),
            pad=plan.pad,
        )
        return batches, start, n, where

    def _costs(self, plan):
        """Each batch's cost under the cost model, for the metric lines (`shardtool stats`)."""
        model = self.batching.balance
        if model is None:
            return None
        from ..plan.cost import served_costs

        rows_per_batch = self.batching.batch_size if plan.rows is not None else None
        return served_costs(plan.rows, plan.row_offsets, plan.lengths, plan.offsets, model, rows_per_batch)

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
        return self._obs.metrics(self._epoch, self._served)

    def report_step_time(self, seconds: float) -> None:
        """The time the trainer spent on the batch handed over last, for `shardtool stats` to say
        how much of each step the ranks wait for the slowest (with ``micro_batches``, report each
        micro-batch; a step's add up). Time the rank's own work (forward and backward, e.g. under
        DDP's ``no_sync()``, or until the backward's all-reduce is launched): a time that
        includes the all-reduce is the slowest rank's on every rank. Recorded in a later metric
        line (``metrics_every``); needs ``metrics=True``."""
        if self._served < 1:
            raise ValueError("report_step_time: no batch has been handed over yet")
        self._obs.step_time(self._epoch, self._served - 1, seconds)

    @property
    def metrics_path(self) -> str:
        """This rank's JSONL file of metric lines (one per ``metrics_every`` steps; node-local by default)."""
        return self._obs.file.path

    @property
    def rank_summary(self) -> dict | None:
        """The last cross-rank summary (``metrics_reduce=True``): min/median/max, the slowest rank."""
        return self._obs.rank_summary

    def close(self) -> None:
        self._close_pass()
        if hasattr(self, "_obs"):
            self._obs.close()
        if getattr(self, "_staging", None) is not None:
            self._staging.close()
        for reader in self._readers().values():  # a mixture's every source
            reader.close()


def _dp_dims(dp_dim: str | tuple[str, ...]) -> tuple[str, ...]:
    return (dp_dim,) if isinstance(dp_dim, str) else tuple(dp_dim)
