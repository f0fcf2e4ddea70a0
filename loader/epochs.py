"""One dataset read by epochs: the `BatchSource` of ``ShardedLoader(url)``.

It owns the dataset's reader and plan and the position in it: the epoch, the plan of this rank's
batches in it (its current segment, after an elastic resume), the batches handed over, and with a
batch-size schedule the run's step at the epoch's first batch. Every decision is the planner's
(`shardtool.plan`), a pure function of the metadata, the seed and the layout.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from functools import partial
from typing import Any

import numpy as np

from ..format.manifest import require_packable
from ..plan import Planner, RankPlan, shards_of_groups
from ..plan.about import dataset_identity, describe
from ..plan.batching import default_bucketing
from ..plan.rowsplit import cut_pieces
from ..plan.schedule import StepClock, with_runs
from ..plan.state import LoaderState, StateError, check_compatible
from . import tokenfields
from .batchsource import PassBatches, Reading, without_double_eos
from .errors import LoaderStateError
from .imagerows import ImageSpec
from .imagerows import of_dataset as images_of
from .indexahead import in_background
from .microsteps import MicroSteps
from .planlog import log_plan
from .reader import BatchReader
from .source import SourceSpec
from .workers import PlanBatches

log = logging.getLogger(__name__)

__all__ = ["DatasetEpochs"]


class DatasetEpochs:
    """The epochs of one dataset on this rank (see `ShardedLoader` for what each member means)."""

    def __init__(self, url: Any, reading: Reading, *, steps: int | None, tokens: int | None):
        if steps is not None or tokens is not None:
            raise ValueError(
                "steps= and tokens= give the length of a Mixture; a single dataset is read by epochs "
                "(len(loader) batches each, set_epoch to choose one)"
            )
        self.reading = opts = reading
        self.schedule = opts.opts.schedule  # batch_size by step: the plan is made at its base size
        self.spec = SourceSpec(url, reading.cache_dir, reading.storage_options)
        self.reader = BatchReader(self.spec, pad_id=opts.opts.pad_id)
        self.readers = {str(url): self.reader}
        try:
            ds = self.reader.source.dataset  # metadata only: manifest, summaries, this rank's range's lengths
            batching = without_double_eos(opts.opts.batching, {str(url): ds.manifest.length.get("eos_id")})
            self.token_fields: tuple[str, ...] = ()  # the per-token fields packed batches carry
            self.images: ImageSpec | None = None  # an image-text dataset's images, packed
            if batching.packing is not None:
                try:
                    require_packable(ds.manifest)  # named by the dataset's URL below
                    self.token_fields = tokenfields.of_dataset(ds, opts.opts.token_fields)
                    self.images = images_of(ds, batching.packing.policy)
                    if reading.image_transform is not None and self.images is None:
                        raise ValueError(
                            "image_transform is for image-text datasets (pack --image-field); this has no images"
                        )
                    if self.images is not None and self.schedule is not None and self.schedule.seq_lens:
                        # A cut may fall inside an image's placeholders, which must stay in one row.
                        raise ValueError("seq_len by step is not supported for image-text datasets yet; give one")
                except ValueError as e:
                    raise ValueError(f"{url}: {e}") from None
        except BaseException:
            self.reader.close()
            raise
        self.dataset = ds
        self.fingerprint = dataset_identity(ds)
        if reading.bucketing is None:  # the dataset decides (see ShardedLoader); the plan stays pure
            batching = replace(batching, bucketing=default_bucketing(ds.manifest.length, batching.shuffle))
        self.batching = with_runs(batching, self.schedule)  # a step joins batches: runs of like lengths
        self.planner = Planner(ds, self.batching)
        self.epoch = 0
        # The typed position the plan continues from (`LoaderState`): the epoch and its segments.
        self.state = self.planner.start(0, self.fingerprint, reading.data_layout)  # ValueError: cannot plan
        self._first_step = 0  # the run's step at the epoch's first batch (a batch-size schedule's steps)
        self._cap_noted = False  # the warning that max_docs_per_row closes most rows, said once
        self._plan: RankPlan | None = None
        self.served = 0  # batches of the current plan handed to the training loop
        self.handed_epoch: int | None = None  # the epoch of the batch last handed over
        self._checked_epoch: int | None = None
        self._loaded_epoch: int | None = None  # a loaded state's epoch, until the loader is iterated
        self._after: np.ndarray | None = None  # each pass batch's position after it, where not b + 1
        if not self.reader.source.local:  # its sample indexes and lengths from now on, behind the trainer's set-up
            # The lengths first: the plan waits for them, and the pass's first fetches for the plan.
            group = reading.data_layout.group_of(reading.dp_rank)[0]
            self.planner.expect_lengths(reading.data_layout, group, partial(in_background, ds.lengths_range))
            self.reader.read_indexes_early(self._own_shards())

    def _own_shards(self) -> list[int]:
        """The shards of this DP rank's own range (its data group's), from the plan's shape alone."""
        layout = self.reading.data_layout
        group = layout.group_of(self.reading.dp_rank)[0]
        return shards_of_groups(self.dataset.summaries, self.planner.shape(layout).cuts, [group])

    @property
    def metric_epoch(self) -> int:
        return self.epoch

    @property
    def staged(self) -> Any:
        return self.reader.source

    @property
    def resuming(self) -> bool:
        return self._loaded_epoch is not None

    @property
    def length_field(self) -> str | None:
        return self.dataset.manifest.length.get("field")

    # ------------------------------------------------------------------ epoch and plan
    def at_end(self) -> bool:
        return self._plan is not None and bool(self.served) and self.served >= self._plan.batches_per_rank

    def next_pass(self) -> None:
        self._start_epoch(self.epoch + 1)

    def set_epoch(self, epoch: int) -> None:
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, found {epoch!r}")
        if epoch == self.epoch:
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
            following = epoch == self.epoch + 1 and self._plan is not None
            self._first_step = self._first_step + self._steps()[1] if following else self._steps_before(epoch)
        self.epoch = epoch
        self.state = self.planner.start(epoch, self.fingerprint, self.reading.data_layout)
        self._plan = None
        self.served = 0

    @property
    def plan(self) -> RankPlan:
        if self._plan is None:
            self._plan = self.planner.rank_plan(self.state, self.reading.dp_rank)
            self._log_plan()
        return self._plan

    def _log_plan(self) -> None:
        self._cap_noted = log_plan(
            self.plan, self.epoch, self.reading, self.spec.url, self.batching.packing, cap_noted=self._cap_noted
        )

    # ------------------------------------------------------------------ batch-size schedule
    def step_clock(self, epoch: int | None = None) -> StepClock | None:
        if self.schedule is None:
            return None
        first = self._first_step if epoch is None or epoch == self.epoch else self._steps_before(epoch)
        return StepClock(self.schedule, first)

    def _steps(self) -> tuple[int, int]:
        """(steps handed over, steps) of the current epoch: batches, or with a batch-size
        schedule the steps they make from the epoch's first step (`shardtool.plan.schedule`)."""
        state = self.state.with_served(self.served)
        clock = self.step_clock()
        if clock is None:
            earlier = sum(s.delivered for s in state.segments[:-1])
            return earlier + state.last.delivered, earlier + state.last.steps
        return clock.steps(state)

    def _steps_before(self, epoch: int) -> int:
        """The run's step at ``epoch``'s first batch when every epoch before it ran whole on this
        layout (a plan's count is the same every epoch)."""
        if self.schedule is None:
            raise RuntimeError("shardtool internal error: _steps_before needs a batch-size schedule")
        batches = self.planner.start(0, self.fingerprint, self.reading.data_layout).last.batches
        return self.schedule.epoch_first_step(epoch, batches)

    def length(self) -> int:
        self.plan  # noqa: B018 - the current segment is planned
        return self._steps()[1]

    def left(self) -> int:
        self.plan  # noqa: B018 - the current segment is planned
        if self.schedule is not None:
            done, total = self._steps()
            return total - done
        return self.state.with_served(self.served).last.left

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        plan = self.plan
        if self.served >= plan.batches_per_rank:
            state = self.planner.start(self.epoch + 1, self.fingerprint, self.reading.data_layout)
            if self.schedule is not None:
                state.step = self._first_step + self._steps()[1]
        else:
            state = self.state.with_served(self.served)
            if self.schedule is not None:
                state.step = self._first_step
        return state.described(self._about()).to_dict()

    def _about(self) -> dict[str, Any]:
        """What this loader's states are saved for, in words: dataset URL and version, batching."""
        return describe(str(self.spec.url), self.dataset.version, len(self.dataset), self.batching)

    def skip_steps(self, first: int, stop: int) -> None:
        try:
            state = self.state.with_served(self.served)
            clock = self.step_clock()
            if clock is not None:  # the steps' planned batches, as the state counts them
                first, stop = clock.batches(state, first, stop)
            state = state.skipping(first, stop)
        except StateError as e:
            raise ValueError(f"cannot skip steps {first}:{stop}: {e}") from None
        self.state, self.served = state, state.last.served
        log.info(
            "epoch %d: skipping steps %d..%d (%d batches a rank never served); the epoch now has %d steps",
            self.epoch,
            first,
            stop - 1,
            stop - first,
            self.length(),
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if isinstance(state, dict) and state.get("kind") == "mixture":
            raise LoaderStateError(
                "cannot load this loader state: it was saved by a loader of a Mixture; load it "
                "into ShardedLoader(Mixture(...)) of those sources"
            )
        try:
            st = LoaderState.from_dict(state, batching=self.batching)
            saved_with = st.batching_fingerprint
            st = check_compatible(st, self.fingerprint, self.batching, self._about())
            if saved_with != st.batching_fingerprint:  # accepted only at an epoch's start
                why = f"saved with another batching config at the start of epoch {st.epoch}"
                log.warning("%s: loader state %s: it is planned with this one, %s", self.spec.url, why, self._about())
            self.planner.check(st)
            resumed = self.planner.continue_on(st, self.reading.data_layout)
            plan = self.planner.rank_plan(resumed, self.reading.dp_rank)
        except ValueError as e:  # StateError, and a plan that cannot be made for it
            raise LoaderStateError(f"cannot load this loader state: {e}") from None
        self.epoch = self._loaded_epoch = st.epoch
        self.handed_epoch = None
        if self.schedule is not None:
            self._first_step = st.step if st.step is not None else self._steps_before(st.epoch)
        self.state = resumed
        self._plan = plan
        self.served = resumed.last.served
        self._log_plan()

    # ------------------------------------------------------------------ a pass
    def check_ranks_agree(self, agree: Any) -> None:
        """One all-reduce per epoch: every rank has the same dataset, config and batch count.

        Without it, a rank on another dataset version would wait forever in the first
        all-reduce of training after the others ran out of batches.
        """
        if self._checked_epoch == self.epoch:
            return
        self._checked_epoch = self.epoch
        agree(
            [self.plan.batches_per_rank, self.served],
            f"{self.fingerprint}/{self.batching.fingerprint()}/{self.epoch}/{self.dataset.summaries.digest()}",
            "(batches per rank, dataset/config/epoch/per-shard summaries, position)",
            "Every rank must open the same dataset version with the same batching and state, and plan from the "
            "same per-shard summaries (a node cache's damaged summaries.arrow: `shardtool cache verify` finds it).",
        )

    def handed_over(self, b: int) -> int:
        """b + 1, or where the pass's batches are not the plan's (past skipped steps, the next one
        to serve; with a batch-size schedule, the end of the step's batches)."""
        self.served = b + 1 if self._after is None else int(self._after[b])
        self.handed_epoch = self.epoch
        return self.served

    def begin_pass(self) -> PassBatches:
        """The pass from the current position: the plan's batches, past skipped steps, and with a
        batch-size schedule each step's batches joined into one (a budget ramp's: listed)."""
        plan = staged = self.plan
        n = plan.batches_per_rank
        self._loaded_epoch = None  # the resume took effect: going back from here on is deliberate
        start = self.served
        self._after = None
        segment = self.state.with_served(start).last
        rows_per_batch: Any = self.batching.batch_size
        seq_lens = None  # a sequence-length schedule: each step's rows' length
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
                if self.schedule.seq_lens:
                    seq_lens = np.array([self.schedule.seq_len_at(step + j) for j in range(bounds.size - 1)], np.int64)
            plan = plan.taking(positions) if segment.skipped else plan
            steps = bounds if segment.skipped else start + bounds
            if self.schedule is not None and not self.schedule.micro:
                plan = plan.grouped(steps)
            self._after = segment.after(positions[bounds[1:] - 1]) if positions.size else np.zeros(0, np.int64)
            start, n = 0, int(bounds.size - 1)
        where = f"rank {self.reading.placement.rank}/{self.reading.placement.layout.world_size}, epoch {self.epoch}"
        batches: Any = self._plan_batches(plan, rows_per_batch, where, seq_lens)
        if self.schedule is not None and self.schedule.micro:
            batches = MicroSteps(batches, steps)  # a budget ramp's step: a list of its planned batches
        return PassBatches(batches, start, n, where, plan=staged)

    def _plan_batches(self, plan: RankPlan, rows_per_batch: Any, where: str, seq_lens: Any = None) -> PlanBatches:
        opts, packing = self.reading.opts, self.batching.packing
        packed = None
        if packing is not None:
            from .packed import PackedReader

            packed = PackedReader(
                self.reader,
                packing,
                name="input_ids",
                pad_id=opts.pad_id,
                rows_per_batch=self.batching.batch_size,
                outputs=opts.packed_outputs,
                token_fields=self.token_fields,
                images=self.images,
                image_transform=self.reading.image_transform,
            )
        scheduled = self.schedule is not None
        return PlanBatches(
            self.reader,
            plan.ids,
            plan.offsets,
            where=where,
            transform=opts.transform,
            collate_fn=opts.collate_fn,
            pad_id=opts.pad_id,
            lengths=plan.lengths,
            packed=packed,
            packed_rows=plan.batch_rows if packed is not None else None,
            packed_stats=_packed_stats(plan, rows_per_batch, seq_lens) if packed is not None else None,
            # Lean chunks lay out batches of one size; a schedule's steps are read one by one.
            packed_pass=(plan.rows, plan.row_offsets) if packed is not None and not scheduled else None,
            rows_per_batch=rows_per_batch if packed is not None and scheduled else None,
            seq_lens=seq_lens,
            costs=self._costs(plan, rows_per_batch, seq_lens),
            pad=plan.pad,
        )

    def _costs(self, plan: RankPlan, rows_per_batch: Any, seq_lens: Any = None) -> Any:
        """Each batch's cost under the cost model, for the metric lines (`shardtool stats`); a
        scheduled step's, of the rows (``rows_per_batch``, per step) it joins, cut to its
        ``seq_lens`` under a warmup."""
        model = self.batching.balance
        if model is None:
            return None
        from ..plan.cost import served_costs

        width = rows_per_batch if plan.rows is not None else None
        return served_costs(plan.rows, plan.row_offsets, plan.lengths, plan.offsets, model, width, seq_lens)


def _packed_stats(plan: RankPlan, rows_per_batch: Any, seq_lens: np.ndarray | None) -> tuple:
    """`RankPlan.packed_stats`; with a sequence-length schedule, of the rows each step cuts."""
    stats = plan.packed_stats(rows_per_batch)
    if seq_lens is None or plan.rows is None or plan.row_offsets is None:
        return stats
    return cut_pieces(plan.rows, plan.row_offsets, seq_lens), stats[1], np.asarray(rows_per_batch) * seq_lens
