"""The members of `ShardedLoader` that only one kind of batch source has.

One dataset read by epochs (`loader/epochs.py`) has an epoch, a plan of this rank's batches, a
remainder and a batch-size schedule; a mixture run for steps (`loader/mixed.py`) has a step, its
sources' datasets and epochs, and a report. The loader answers each from its source, and on the
other kind says in one place what to use instead. A mixin of `ShardedLoader`: it reads the
loader's ``batch_source``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..plan import RankPlan
from ..plan.schedule import StepClock
from .epochs import DatasetEpochs
from .errors import LoaderStateError
from .mixed import MixtureSteps
from .reader import BatchReader
from .source import SourceSpec

__all__ = ["SourceViews"]

_MIXTURE_PLAN = "see loader.report() and each batch's per_source"
_MIXTURE_INSTEAD = {
    "epoch": (
        "it runs for steps= steps (loader.step served so far, len(loader) left); each source's own "
        "passes are in loader.source_epochs"
    ),
    "remainder": "each source's own passes leave theirs",
    "padding efficiency": "each source's padding depends on its lengths",
}


class SourceViews:
    """What a loader of one dataset, or of a mixture, answers beyond what both do."""

    batch_source: Any
    packing: Any  # ShardedLoader's: the plan's `shardtool.plan.packing.Packing`, or None

    def _settle(self) -> None:
        raise NotImplementedError  # PassRunner's: the next epoch once this one was handed over

    # ------------------------------------------------------------------ one dataset's epochs
    def _epochs(self, what: str) -> DatasetEpochs:
        """The epochs of one dataset, or the error saying that a mixture has no ``what``."""
        source = self.batch_source
        if not isinstance(source, DatasetEpochs):
            raise AttributeError(f"a mixture has no {what}: {_MIXTURE_INSTEAD.get(what, _MIXTURE_PLAN)}")
        return source

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        self._settle()
        return self._epochs("epoch").epoch

    @property
    def handed_epoch(self) -> int | None:
        """The epoch of the batch last handed to the training loop (None before the first, and
        after a state is loaded). While an epoch's last batch is in hand, `epoch` (and a state
        saved then) is already the next one's; this is still that batch's."""
        return self._epochs("handed_epoch").handed_epoch

    def set_epoch(self, epoch: int) -> None:
        """Serve ``epoch`` next (its own shuffle); refused before a loaded state's epoch."""
        if not isinstance(self.batch_source, DatasetEpochs):
            raise LoaderStateError(
                f"set_epoch({epoch!r}) on a mixture: a mixture has no epoch. It yields steps= steps in "
                "one pass (len(loader) left) and resumes from state_dict(); each source repeats with "
                "a fresh shuffle on its own. Drop the set_epoch call (and the epoch loop around it)"
            )
        self._settle()
        self.batch_source.set_epoch(epoch)

    @property
    def dataset(self) -> Any:
        """The `shardtool.format.Dataset` read (metadata: manifest, summaries, lengths)."""
        return self._epochs("single dataset").dataset

    @property
    def reader(self) -> BatchReader:
        """This process's reader of the dataset's shards."""
        return self._epochs("single dataset").reader

    @property
    def spec(self) -> SourceSpec:
        """Where the dataset is read from: its URL, the node cache, the storage options."""
        return self._epochs("single dataset").spec

    @property
    def fingerprint(self) -> str:
        """The dataset's version (marked where its ranges are cut by sample count,
        `shardtool.plan.about.dataset_identity`), which states are saved for."""
        return self._epochs("single dataset").fingerprint

    @property
    def schedule(self) -> Any:
        """The schedule by step of the batch size and the row length (`shardtool.plan.schedule.Schedule`),
        or None; a mixture's too."""
        return self.batch_source.schedule

    def step_clock(self, epoch: int | None = None) -> StepClock | None:
        """The batch-size schedule's steps over ``epoch`` (default: the current one, from where
        the loader's state says it began; another one as if every epoch before it ran whole on
        this layout); None without a schedule. `shardtool.loader.trace` maps steps with it."""
        return self._epochs("batch-size schedule").step_clock(epoch)

    @property
    def plan(self) -> RankPlan:
        """This rank's batches in the current epoch (segment): planned from its own group's range."""
        return self._epochs("plan").plan

    @property
    def remainder(self) -> np.ndarray:
        """Global ids of the samples of this rank's data group that no rank serves this epoch (they
        rotate across epochs; documents ``no-split`` drops for being longer than a row are not in
        it: they are never served, and `shardtool plan` counts them as dropped). After an elastic
        resume, the epoch's rest is re-dealt whole batches in equal shares: the samples of the few
        batches left over (``plan.leftover_batches``, fewer than the DP ranks), the same on every
        rank."""
        epochs = self._epochs("remainder")
        rem = epochs.plan.remainder
        if rem is not None:
            return rem
        left = epochs.planner.left_over(epochs.state) if epochs.plan.leftover_batches else []
        return np.unique(np.concatenate(left)) if left else np.zeros(0, np.int64)

    @property
    def remainder_tokens(self) -> int:
        """Tokens of this rank's data group that no rank serves this epoch: with packing, of the
        pieces left out for equal counts (eos counted), which `remainder` (documents no token of
        which is served) does not show. 0 with drop_last=False, and after an elastic resume."""
        got = self._epochs("remainder").plan.remainder_tokens
        return int(got) if got is not None else 0

    @property
    def remainder_pieces(self) -> int:
        """Pieces of documents (packed) or samples that make up `remainder_tokens`."""
        got = self._epochs("remainder").plan.remainder_pieces
        return int(got) if got is not None else 0

    @property
    def padding_efficiency(self) -> float:
        """Real tokens / tokens of the padded batches: bucketed batches, or packed rows (fill rate)."""
        plan = self._epochs("padding efficiency").plan
        return plan.fill_rate if self.packing is not None else plan.padding_efficiency

    # ------------------------------------------------------------------ a mixture's steps
    def _steps(self, what: str) -> MixtureSteps:
        source = self.batch_source
        if not isinstance(source, MixtureSteps):
            raise AttributeError(f"{what} belongs to a loader of a Mixture; this one reads one dataset by epochs")
        return source

    @property
    def steps(self) -> int:
        """A mixture's length in steps (global batches)."""
        return self._steps("steps").run_steps

    @property
    def step(self) -> int:
        """Steps (global batches) of a mixture handed to the training loop so far."""
        return self._steps("step").served

    @property
    def datasets(self) -> dict[str, Any]:
        """A mixture's datasets, by source name."""
        return self._steps("datasets").datasets

    @property
    def source_epochs(self) -> dict[str, int]:
        """The source-epoch every source of a mixture is in at the current step."""
        return self._steps("source_epochs").source_epochs

    def report(self) -> dict[str, Any]:
        """Where a mixture's run is, per source: the schedule's token share and the composition's
        over the current phase so far, units and expected tokens so far in the phase (closed
        form, no I/O), the source-epoch it is in and the source-epochs it will have begun by
        ``steps``."""
        return self._steps("report()").report()
