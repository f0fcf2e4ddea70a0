"""`ShardedLoader(Mixture(...), steps=...)`: batches of several datasets by token weights, resumable.

`ShardedLoader` constructs this class when given a `shardtool.plan.mixture.Mixture`; everything
but the dataset (layout, batching or packing, workers, caches) is configured as for one dataset.
A mixture has no epoch: it runs for ``steps`` steps (or ``tokens`` expected tokens, converted
into steps), each source passing over its data as often as the weights need, with a fresh
shuffle each time, up to ``max_repeat`` passes (refused before the first batch otherwise).
"""

from __future__ import annotations

import logging
from typing import Any

from ..format import ShardtoolError
from ..plan.mixture import Mixture, MixtureError
from ..plan.mixture.planner import MixturePlanner
from ..plan.mixture.span import check_repeat, span, steps_for_tokens
from ..plan.mixture.state import MixtureState, source_changes
from ..plan.state import StateError
from . import tokenfields
from .errors import LoaderStateError
from .imagerows import ImageSpec
from .imagerows import of_dataset as images_of
from .mixbatches import MixtureBatches
from .reader import BatchReader
from .sharded import ShardedLoader
from .source import SourceSpec

log = logging.getLogger(__name__)

__all__ = ["MixtureLoader"]


class MixtureLoader(ShardedLoader, serves=Mixture):
    """The loader of a mixture (see the module docstring and `ShardedLoader`).

    ``len(loader)`` is ``steps``, the whole run, also after a resume (a trainer counts the steps
    done); ``batches_left`` is the steps the next pass yields, after which the loader is done. ``state_dict()`` is the step and the current phase (JSON, identical
    on every rank); ``load_state_dict`` continues there — also under other weights or schedule,
    with sources added or removed, or on another data layout, each source from its own cursor."""

    def _open(
        self,
        mixture: Mixture,
        *,
        cache_dir: str | None,
        storage_options: dict | None,
        steps: int | None,
        tokens: int | None,
    ) -> None:
        if self.packed_outputs == "lean":
            raise ValueError(
                "packed_outputs='lean' is for one dataset; a mixture's packed steps are full batches "
                "(input_ids, labels, position_ids, cu_seqlens)"
            )
        if self.batching.exact:
            raise ValueError(
                "exact=True serves one dataset's samples once each; a mixture has no end to serve "
                "them by: evaluate each source with its own ShardedLoader(url, exact=True)"
            )
        if self.batching.balance is not None:
            raise ValueError(
                "cost_model balances the steps of one dataset; a mixture's steps are not balanced yet "
                "(its sources are planned apart): drop cost_model for a Mixture"
            )
        if (steps is None) == (tokens is None):
            raise ValueError(
                "a mixture has no epoch: give its length as exactly one of steps= (global batches) "
                f"and tokens= (expected tokens, all ranks); found steps={steps!r}, tokens={tokens!r}"
            )
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ValueError(f"steps must be an int >= 1, found {steps!r}")
        self.mixture = mixture
        self.readers: dict[str, BatchReader] = {}
        datasets, versions = {}, {}
        try:
            for src in mixture.sources:
                self.readers[src.name] = reader = BatchReader(
                    SourceSpec(src.url, cache_dir, storage_options), pad_id=self.pad_id
                )
                try:
                    datasets[src.name] = reader.source.dataset
                except ShardtoolError as e:
                    raise type(e)(f"mixture source {src.name!r}: {e}") from None
                versions[src.name] = datasets[src.name].version
            self.datasets = datasets
            self._no_double_eos(
                {f"mixture source {n!r}": ds.manifest.length.get("eos_id") for n, ds in datasets.items()}
            )
            self.source_images: dict[str, ImageSpec | None] = {}  # each source's images (image-text ones)
            if self.packing is not None:
                self.token_fields = self._mixture_token_fields(datasets)
                for n, ds in datasets.items():
                    try:
                        self.source_images[n] = images_of(ds, self.packing.policy)
                    except ValueError as e:
                        raise ValueError(f"mixture source {n!r}: {e}") from None
                if self.image_transform is not None and not any(self.source_images.values()):
                    raise ValueError("image_transform is for image-text sources (pack --image-field); none has images")
            self.planner = MixturePlanner(mixture, datasets, versions, self.batching, self.data_layout)
            self._state = self.planner.start()
            self.steps = steps if steps is not None else steps_for_tokens(self.planner, self._state, tokens)
            check_repeat(self.planner, self._state, self.steps)
        except BaseException:
            self.close()
            raise
        self._served = 0
        self._loaded = False  # a state was loaded and no pass has begun since
        self._epoch = 0  # for the metrics' pass bookkeeping only: the whole run is one pass
        self._checked = False

    def _mixture_token_fields(self, datasets: dict) -> tuple[str, ...]:
        """The per-token fields every source carries alike: a step's rows come from several
        sources, and a field some of them lack would have no values in their rows."""
        per = {}
        for name, ds in datasets.items():
            try:
                per[name] = tokenfields.of_dataset(ds, self._token_fields_wanted)
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
    @property
    def epoch(self) -> int:
        raise AttributeError(
            "a mixture has no epoch: it runs for steps= steps (loader.step served so far, "
            "len(loader) left); each source's own passes are in loader.source_epochs"
        )

    def set_epoch(self, epoch: int) -> None:
        raise LoaderStateError(
            f"set_epoch({epoch!r}) on a mixture: a mixture has no epoch. It yields steps= steps in "
            "one pass (len(loader) left) and resumes from state_dict(); each source repeats with "
            "a fresh shuffle on its own. Drop the set_epoch call (and the epoch loop around it)"
        )

    @property
    def step(self) -> int:
        """Steps (global batches) handed to the training loop so far."""
        return self._served

    def __len__(self) -> int:
        return self.steps

    @property
    def batches_left(self) -> int:
        return self.steps - self._served

    @property
    def resuming(self) -> bool:
        return self._loaded

    @property
    def source_epochs(self) -> dict[str, int]:
        """The source-epoch every source is in at the current step."""
        return {n: st.epoch for n, st in self.planner.positions(self._state.at(self._served)).items()}

    @property
    def length_field(self) -> str | None:
        if self.packing is not None:
            return "input_ids"
        fields = {ds.manifest.length.get("field") for ds in self.datasets.values()}
        if len(fields) != 1:
            raise ValueError(
                f"the sources of this mixture store their tokens under different fields {sorted(map(str, fields))}; "
                "each batch carries its own source's field (batch['__source__'] names the source)"
            )
        return fields.pop()

    @property
    def plan(self) -> Any:
        raise AttributeError("a mixture has no single plan: see loader.report() and each batch's per_source")

    @property
    def remainder(self) -> Any:
        raise AttributeError("a mixture has no epoch remainder: each source's own passes leave theirs")

    @property
    def padding_efficiency(self) -> float:
        raise AttributeError("a mixture has no single plan: each source's padding depends on its lengths")

    def report(self) -> dict[str, Any]:
        """Where the run is, per source: the schedule's token share and the composition's over the
        current phase so far, units and expected tokens so far in the phase (closed form, no I/O),
        the source-epoch it is in and the source-epochs it will have begun by ``steps``."""
        st = self._state
        begin = st.at(st.phase.from_step)
        done = {s.name: s for s in span(self.planner, begin, self._served)}
        whole = {s.name: s for s in span(self.planner, begin, self.steps)}
        epochs = self.source_epochs
        per = {
            name: {
                "weight_share": whole[name].weight_share,
                "realized_share": done[name].realized_share if self._served > begin.step else None,
                "units_in_phase": done[name].units,
                "tokens_in_phase": done[name].tokens,
                "source_epoch": epochs[name],
                "source_epochs_by_end": whole[name].epochs_touched,
            }
            for name in st.phase.names
        }
        return {
            "step": self._served,
            "steps": self.steps,
            "phase_from_step": st.phase.from_step,
            "phases_before": st.phases_before,
            "per_source": per,
        }

    # ------------------------------------------------------------------ state
    def skip_steps(self, first: int, stop: int) -> None:
        """Never serve the data of steps ``first .. stop - 1`` (after ``load_state_dict``, before
        the first batch): the steps go on counting and the data moves past them, as for one
        dataset: step ``first`` takes what step ``stop`` would have, every source as far ahead,
        and the run still ends at ``steps``. Recorded in `state_dict` (a later resume, with new
        weights or on another layout too, keeps it; `shardtool trace` answers for the run as it
        went). Every rank must skip the same steps; a later skip may not start before an
        earlier one."""
        self._before_first_batch("skip_steps")
        try:
            if isinstance(stop, int) and stop > self.steps:
                raise StateError(f"the run ends at steps={self.steps}: give stop <= {self.steps}, found {stop}")
            skipped = self._state.at(self._served).skipping(first, stop)
        except StateError as e:
            raise ValueError(f"cannot skip steps {first!r}:{stop!r}: {e}") from None
        check_repeat(self.planner, skipped, self.steps)  # the data moved on: max_repeat may now bind
        self._state = skipped
        self._checked = False
        log.info(
            "mixture: skipping the data of steps %d..%d; step %d takes step %d's, the run still ends at step %d",
            first,
            stop - 1,
            first,
            stop,
            self.steps,
        )

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch handed out: small, JSON-ready, equal on every rank, no I/O."""
        return self._state.at(self._served).to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at ``state``'s step. Unchanged mixture and layout: the next batch exactly. Other
        weights or schedule, sources added or removed, another data layout: a new phase from that
        step in which every kept source continues from its cursor (nothing repeated, nothing
        skipped), a new source starts at its beginning. Refuses a state of another dataset
        version, batching config, or one past ``steps``."""
        try:
            st = MixtureState.from_dict(state)
            resumed = self.planner.resume(st)
            if resumed.step > self.steps:
                raise StateError(
                    f"the loader state is at step {resumed.step}, past steps={self.steps}: nothing is left "
                    "to serve; give the run's whole length as steps="
                )
            check_repeat(self.planner, resumed, self.steps)
        except MixtureError:
            raise  # max_repeat: the table says what to change
        except ValueError as e:  # StateError, and a plan that cannot be made for it
            raise LoaderStateError(f"cannot load this loader state: {e}") from None
        if resumed.phase is not st.phase:
            self._log_phase_change(st, resumed)
        self._state = resumed
        self._served = resumed.step
        self._checked = False
        self._loaded = True

    @staticmethod
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

    # ------------------------------------------------------------------ iteration
    def _at_epoch_end(self) -> bool:
        return False  # no epochs: the run ends at steps, and the state says step == steps

    def _begin_pass(self) -> tuple[Any, int, int, str]:
        start = self._served
        self._loaded = False
        self._check_mixture_ranks_agree()
        where = f"rank {self.rank}/{self.layout.world_size}"
        batches = MixtureBatches(
            self.planner,
            self._state,
            self.dp_rank,
            self.readers,
            self.steps,
            where=where,
            transform=self.transform,
            collate_fn=self.collate_fn,
            pad_id=self.pad_id,
            packing=self.packing,
            token_fields=self.token_fields,
            images=self.source_images,
            image_transform=self.image_transform,
        )
        if start < self.steps:
            batches.prepare(start)  # before the workers fork: they inherit these plans
        return batches, start, self.steps, where

    def _pass_done(self) -> None:
        pass  # the run is over: batches_left is 0, the state says step == steps

    def _check_mixture_ranks_agree(self) -> None:
        """Once per loaded position: every rank has the same sources, config, phase and step."""
        if self._checked or not self._in_process_group():
            return
        self._checked = True
        position = self._state.at(0).to_dict()
        position.pop("about", None)  # words for people (URLs as each rank spelled them), not the data's identity
        ident = f"{self.planner.fingerprint}/{position}"
        self._agree(
            [self.steps, self._served],
            ident,
            "(steps, mixture/state, step)",
            "Every rank must open the same mixture (sources, weights, versions) with the same batching and state.",
        )

    def _readers(self) -> dict[str, BatchReader]:
        return getattr(self, "readers", {})  # close() after a source failed to open: the ones opened
