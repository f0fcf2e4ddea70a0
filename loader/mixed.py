"""A mixture run for steps: the `BatchSource` of ``ShardedLoader(Mixture(...), steps=...)``.

Everything but the dataset (layout, batching or packing, workers, caches) is configured as for
one dataset. A mixture has no epoch: it runs for ``steps`` steps (or ``tokens`` expected tokens,
converted into steps), each source passing over its data as often as the weights need, with a
fresh shuffle each time, up to ``max_repeat`` passes (refused before the first batch otherwise).
"""

from __future__ import annotations

import logging
from typing import Any

from ..format import ShardtoolError
from ..format.manifest import require_packable
from ..plan.about import dataset_identity
from ..plan.mixture import Mixture, MixtureError
from ..plan.mixture.planner import MixturePlanner, rows_by_step
from ..plan.mixture.span import check_repeat, span, steps_for_tokens
from ..plan.mixture.state import MixtureState, source_changes
from ..plan.state import StateError
from . import tokenfields
from .batchsource import PassBatches, Reading, without_double_eos
from .errors import LoaderStateError
from .imagerows import ImageSpec
from .imagerows import of_dataset as images_of
from .mixbatches import MixtureBatches
from .reader import BatchReader
from .source import SourceSpec

log = logging.getLogger(__name__)

__all__ = ["MixtureSteps"]


class MixtureSteps:
    """The steps of a mixture on this rank (see the module docstring and `ShardedLoader`).

    ``len(loader)`` is ``steps``, the whole run, also after a resume (a trainer counts the steps
    done); ``batches_left`` is the steps the next pass yields, after which the loader is done.
    ``state_dict()`` is the step and the current phase (JSON, identical on every rank);
    ``load_state_dict`` continues there, also under other weights or schedule, with sources added
    or removed, or on another data layout, each source from its own cursor."""

    metric_epoch = 0  # the metrics' pass bookkeeping: the whole run is one pass
    staged = None  # a mixture is not staged: each source's shards are fetched on a miss

    def __init__(self, mixture: Mixture, reading: Reading, *, steps: int | None, tokens: int | None):
        batching, opts = reading.opts.batching, reading.opts
        batching, rows = rows_by_step(opts.schedule, batching)
        if opts.packed_outputs == "lean":
            raise ValueError(
                "packed_outputs='lean' is for one dataset; a mixture's packed steps are full batches "
                "(input_ids, labels, position_ids, cu_seqlens)"
            )
        if batching.exact:
            raise ValueError(
                "exact=True serves one dataset's samples once each; a mixture has no end to serve "
                "them by: evaluate each source with its own ShardedLoader(url, exact=True)"
            )
        if (steps is None) == (tokens is None):
            raise ValueError(
                "a mixture has no epoch: give its length as exactly one of steps= (global batches) "
                f"and tokens= (expected tokens, all ranks); found steps={steps!r}, tokens={tokens!r}"
            )
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ValueError(f"steps must be an int >= 1, found {steps!r}")
        self.mixture, self.reading = mixture, reading
        self.schedule = opts.schedule  # rows by step are the planner's; a warmup's lengths are read here
        self.readers: dict[str, BatchReader] = {}
        self.token_fields: tuple[str, ...] = ()
        datasets, versions = {}, {}
        try:
            for src in mixture.sources:
                self.readers[src.name] = reader = BatchReader(
                    SourceSpec(src.url, reading.cache_dir, reading.storage_options), pad_id=opts.pad_id
                )
                try:
                    datasets[src.name] = reader.source.dataset
                except ShardtoolError as e:
                    raise type(e)(f"mixture source {src.name!r}: {e}") from None
                versions[src.name] = dataset_identity(datasets[src.name])
            self.datasets = datasets
            self.batching = batching = without_double_eos(
                batching, {f"mixture source {n!r}": ds.manifest.length.get("eos_id") for n, ds in datasets.items()}
            )
            self.source_images: dict[str, ImageSpec | None] = {}  # each source's images (image-text ones)
            if batching.packing is not None:
                for n, ds in datasets.items():
                    require_packable(ds.manifest, f"mixture source {n!r} ({ds.url})")
                self.token_fields = self._mixture_token_fields(datasets)
                for n, ds in datasets.items():
                    try:
                        self.source_images[n] = images_of(ds, batching.packing.policy)
                    except ValueError as e:
                        raise ValueError(f"mixture source {n!r}: {e}") from None
                if reading.image_transform is not None and not any(self.source_images.values()):
                    raise ValueError("image_transform is for image-text sources (pack --image-field); none has images")
                if opts.schedule is not None and opts.schedule.seq_lens and any(self.source_images.values()):
                    # A cut may fall inside an image's placeholders, which must stay in one row.
                    raise ValueError("seq_len by step is not supported for image-text sources yet; give one")
            self.planner = MixturePlanner(mixture, datasets, versions, batching, reading.data_layout, rows)
            self.state = self.planner.start()  # the typed position (`MixtureState`): step and phase
            if steps is not None:
                self.run_steps = steps
            else:
                if tokens is None:
                    raise RuntimeError("shardtool internal error: exactly one of steps and tokens (checked above)")
                self.run_steps = steps_for_tokens(self.planner, self.state, tokens)
            check_repeat(self.planner, self.state, self.run_steps)
        except BaseException:
            for reader in self.readers.values():
                reader.close()
            raise
        self.served = 0
        self.resuming = False  # a state was loaded and no pass has begun since
        self._checked = False

    def _mixture_token_fields(self, datasets: dict) -> tuple[str, ...]:
        """The per-token fields every source carries alike: a step's rows come from several
        sources, and a field some of them lack would have no values in their rows."""
        per = {}
        for name, ds in datasets.items():
            try:
                per[name] = tokenfields.of_dataset(ds, self.reading.opts.token_fields)
            except ValueError as e:
                raise ValueError(f"mixture source {name!r}: {e}") from None
        if len(set(per.values())) > 1:
            raise ValueError(
                "the sources of this mixture carry different per-token fields "
                f"({', '.join(f'{n}: {list(f)}' for n, f in per.items())}); packed steps mix their rows, so "
                "each field must be in every source: pack them alike, or choose with token_fields=[...]"
            )
        return next(iter(per.values()))

    # ------------------------------------------------------------------ length and position
    def length(self) -> int:
        return self.run_steps

    def left(self) -> int:
        return self.run_steps - self.served

    @property
    def source_epochs(self) -> dict[str, int]:
        """The source-epoch every source is in at the current step."""
        return {n: st.epoch for n, st in self.planner.positions(self.state.at(self.served)).items()}

    @property
    def length_field(self) -> str | None:
        if self.batching.packing is not None:
            return "input_ids"
        fields = {ds.manifest.length.get("field") for ds in self.datasets.values()}
        if len(fields) != 1:
            raise ValueError(
                f"the sources of this mixture store their tokens under different fields {sorted(map(str, fields))}; "
                "each batch carries its own source's field (batch['__source__'] names the source)"
            )
        return fields.pop()

    def report(self) -> dict[str, Any]:
        """Where the run is, per source: the schedule's token share and the composition's over the
        current phase so far, units and expected tokens so far in the phase (closed form, no I/O),
        the source-epoch it is in and the source-epochs it will have begun by ``steps``."""
        st = self.state
        begin = st.at(st.phase.from_step)
        done = {s.name: s for s in span(self.planner, begin, self.served)}
        whole = {s.name: s for s in span(self.planner, begin, self.run_steps)}
        epochs = self.source_epochs
        per = {
            name: {
                "weight_share": whole[name].weight_share,
                "realized_share": done[name].realized_share if self.served > begin.step else None,
                "units_in_phase": done[name].units,
                "tokens_in_phase": done[name].tokens,
                "source_epoch": epochs[name],
                "source_epochs_by_end": whole[name].epochs_touched,
            }
            for name in st.phase.names
        }
        return {
            "step": self.served,
            "steps": self.run_steps,
            "phase_from_step": st.phase.from_step,
            "phases_before": st.phases_before,
            "per_source": per,
        }

    # ------------------------------------------------------------------ state
    def skip_steps(self, first: int, stop: int) -> None:
        try:
            if isinstance(stop, int) and stop > self.run_steps:
                raise StateError(f"the run ends at steps={self.run_steps}: give stop <= {self.run_steps}, found {stop}")
            skipped = self.state.at(self.served).skipping(first, stop)
        except StateError as e:
            raise ValueError(f"cannot skip steps {first!r}:{stop!r}: {e}") from None
        check_repeat(self.planner, skipped, self.run_steps)  # the data moved on: max_repeat may now bind
        self.state = skipped
        self._checked = False
        log.info(
            "mixture: skipping the data of steps %d..%d; step %d takes step %d's, the run still ends at step %d",
            first,
            stop - 1,
            first,
            stop,
            self.run_steps,
        )

    def state_dict(self) -> dict[str, Any]:
        return self.state.at(self.served).to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            st = MixtureState.from_dict(state)
            resumed = self.planner.resume(st)
            if resumed.step > self.run_steps:
                raise StateError(
                    f"the loader state is at step {resumed.step}, past steps={self.run_steps}: nothing is left "
                    "to serve; give the run's whole length as steps="
                )
            check_repeat(self.planner, resumed, self.run_steps)
        except MixtureError:
            raise  # max_repeat: the table says what to change
        except ValueError as e:  # StateError, and a plan that cannot be made for it
            raise LoaderStateError(f"cannot load this loader state: {e}") from None
        if resumed.phase is not st.phase:
            _log_phase_change(st, resumed)
        self.state = resumed
        self.served = resumed.step
        self._checked = False
        self.resuming = True

    # ------------------------------------------------------------------ a pass
    def at_end(self) -> bool:
        return False  # no epochs: the run ends at steps, and the state says step == steps

    def next_pass(self) -> None:
        pass  # the run is over: batches_left is 0, the state says step == steps

    def handed_over(self, b: int) -> int:
        self.served = b + 1
        return self.served

    def check_ranks_agree(self, agree: Any) -> None:
        """Once per loaded position: every rank has the same sources, config, phase and step."""
        if self._checked:
            return
        self._checked = True
        position = self.state.at(0).to_dict()
        position.pop("about", None)  # words for people (URLs as each rank spelled them), not the data's identity
        agree(
            [self.run_steps, self.served],
            f"{self.planner.fingerprint}/{position}",
            "(steps, mixture/state, step)",
            "Every rank must open the same mixture (sources, weights, versions) with the same batching and state.",
        )

    def begin_pass(self) -> PassBatches:
        start = self.served
        self.resuming = False
        opts, where = (
            self.reading.opts,
            f"rank {self.reading.placement.rank}/{self.reading.placement.layout.world_size}",
        )
        batches = MixtureBatches(
            self.planner,
            self.state,
            self.reading.dp_rank,
            self.readers,
            self.run_steps,
            where=where,
            transform=opts.transform,
            collate_fn=opts.collate_fn,
            pad_id=opts.pad_id,
            packing=self.batching.packing,
            token_fields=self.token_fields,
            images=self.source_images,
            image_transform=self.reading.image_transform,
            schedule=self.schedule,
            cost_model=self.batching.balance,
        )
        if start < self.run_steps:
            batches.prepare(start)  # before the workers fork: they inherit these plans
        return PassBatches(batches, start, self.run_steps, where)


def _log_phase_change(old: MixtureState, new: MixtureState) -> None:
    # What the run trains on changed: a warning, as it shows in the loss curve and nowhere
    # else. A new layout alone (an elastic resume) changes nobody's data.
    for change in source_changes(old.phase, new.phase):  # a line each: one source, or the weights
        log.warning("mixture resumed at step %d with what it trains on changed: %s", new.step, change)
    if old.phase.layout.identity() != new.phase.layout.identity():
        log.info(
            "mixture resumed at step %d on another layout: %s -> %s",
            new.step,
            old.phase.layout.identity(),
            new.phase.layout.identity(),
        )
