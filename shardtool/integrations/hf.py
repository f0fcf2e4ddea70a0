"""`ShardedLoader` as the train loader of a Hugging Face ``transformers.Trainer`` (and with ``accelerate``).

What the Trainer's protocol needs, and nothing more (the position lives in the loader only):

* The loader itself is the train dataloader: ``get_train_dataloader`` would wrap a dataset in a
  ``DataLoader`` with a sampler and ``accelerator.prepare`` it into a ``DataLoaderShard`` that
  splits it again over the ranks; each rank's ShardedLoader already serves only its own batches.
* ``len()`` is the whole epoch: the Trainer derives steps per epoch from it, and on resume the
  epoch and the batches done in it from ``global_step`` (as `ShardedLoader`'s own ``len()``
  counts, after a resume too).
* The state goes into every ``checkpoint-N`` folder as ``shardtool_loader.json`` (written where
  the Trainer writes ``trainer_state.json``: once, the state being the same on every rank) and is
  loaded on ``train(resume_from_checkpoint=...)`` before the Trainer reads ``len()``.
* No replay: on resume the Trainer calls ``skip_first_batches`` (accelerate), which would read
  and drop every batch already trained on. The Trainer offers no hook for it, so `ShardedTrainer`
  replaces the name in ``transformers.trainer`` with a function that is the identity for a
  `TrainerLoader` (the loaded state is already there) and calls accelerate's for anything else.
  It checks at every epoch start that the loader's position is the Trainer's step, and raises
  rather than train on other batches.
* Only the batch fields the model's ``forward`` accepts are passed on (the Trainer's own
  ``remove_unused_columns`` rule for datasets), since the Trainer calls ``model(**batch)``.

``accelerate`` needs no adapter: ``accelerator.prepare`` passes anything that is not a torch
``DataLoader`` through unchanged, and ``accelerator.register_for_checkpointing(loader)`` saves
``loader.state_dict()`` with ``save_state`` (``custom_checkpoint_<i>.pkl``, written by the main
process) and loads it on every rank with ``load_state``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from typing import Any

import transformers
import transformers.trainer as _trainer_module
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from ..loader import LoaderError, LoaderStateError, ShardedLoader
from ..plan.state import LoaderState, StateError
from .position import one_dataset, position

__all__ = ["STATE_FILE", "ShardedTrainer", "TrainerLoader"]

log = logging.getLogger(__name__)

STATE_FILE = "shardtool_loader.json"


class TrainerLoader:
    """A `ShardedLoader` as the Trainer expects its train dataloader (see the module docstring)."""

    def __init__(self, loader: ShardedLoader):
        self.loader = one_dataset(loader, "TrainerLoader", "the Trainer counts epochs from len()")
        self.columns: set[str] | None = None  # the fields passed to the model; None: all

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)

    def position(self) -> tuple[int, int]:
        """(epoch, batches this rank has had in it): where the next batch comes from."""
        return position(self.loader)

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        # The Trainer calls it at every epoch start; for the epoch the loader is in, it keeps the position.
        self.loader.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        columns = self.columns
        for batch in self.loader:
            yield batch if columns is None else {k: v for k, v in batch.items() if k in columns}

    def close(self) -> None:
        self.loader.close()


def _skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    # A TrainerLoader is already at the resumed position (ShardedTrainer checks it just before).
    if isinstance(dataloader, TrainerLoader):
        return dataloader
    return _skip_first_batches.original(dataloader, num_batches)


def _install_skip() -> None:
    """Make the Trainer's ``skip_first_batches`` the identity for a `TrainerLoader`, and only for it."""
    current = getattr(_trainer_module, "skip_first_batches", None)
    if current is _skip_first_batches:
        return
    if current is None or not callable(getattr(transformers.Trainer, "_run_epoch", None)):
        raise ImportError(
            f"transformers {transformers.__version__} does not resume through "
            f"Trainer._run_epoch and transformers.trainer.skip_first_batches; ShardedTrainer cannot "
            f"keep it from replaying the loader. Use the transformers it was tested with (5.24), or "
            f"accelerate directly"
        )
    _skip_first_batches.original = current
    _trainer_module.skip_first_batches = _skip_first_batches


class ShardedTrainer(transformers.Trainer):
    """``transformers.Trainer`` training from a `ShardedLoader`, resumed exactly from its checkpoints.

    ``ShardedTrainer(model, args, train_loader=ShardedLoader(...), ...)`` instead of ``train_dataset``;
    ``trainer.train(resume_from_checkpoint=...)`` continues at the next batch on every rank, with no
    batch replayed. The batch size is the loader's (``per_device_train_batch_size`` only enters the
    Trainer's logged totals). ``ignore_data_skip=True`` starts the checkpoint's epoch over, as it does
    for a dataset. Resuming on another number of ranks or nodes is refused with a `LoaderStateError`
    (the Trainer's epoch bookkeeping assumes one epoch length).
    """

    def __init__(self, *args: Any, train_loader: ShardedLoader, **kwargs: Any):
        if kwargs.get("train_dataset") is not None:
            raise ValueError("ShardedTrainer trains from train_loader; leave train_dataset out")
        super().__init__(*args, **kwargs)
        self.train_loader = TrainerLoader(train_loader)
        self._resume_dir: str | None = None
        _install_skip()

    # ------------------------------------------------------------------ resume
    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any):
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
        self._resume_dir = resume_from_checkpoint or None
        try:
            return super().train(resume_from_checkpoint=self._resume_dir, **kwargs)
        finally:
            self._resume_dir = None

    def get_train_dataloader(self) -> TrainerLoader:
        view = self.train_loader
        if self._resume_dir is not None and not self.args.ignore_data_skip:
            # Before the Trainer reads len(): the resumed epoch's length is counted from the state.
            state = read_state(self._resume_dir)
            self._refuse_another_layout(view, state)
            view.load_state_dict(state)
        if self.args.remove_unused_columns:
            self._set_signature_columns_if_needed()
            view.columns = set(self._signature_columns)
        return view

    def _refuse_another_layout(self, view: TrainerLoader, state: dict[str, Any]) -> None:
        # The loader itself would continue on another number of DP ranks (the epoch's rest re-dealt),
        # but the Trainer derives epoch and step from global_step and one epoch length, which then differ.
        here = LoaderState.from_dict(view.state_dict()).last.layout.identity()
        try:
            saved = LoaderState.from_dict(state).last.layout.identity()
        except StateError:
            return  # load_state_dict refuses it, saying what is wrong with it
        if saved != here:
            raise LoaderStateError(
                f"the checkpoint {self._resume_dir} was saved on {saved['dp_size']} data-parallel ranks "
                f"(groups {saved['groups']}), this run has {here['dp_size']} (groups {here['groups']}): the Trainer "
                f"counts epochs and steps from one epoch length and cannot resume on another layout. Resume on the "
                f"same number of ranks and nodes, or drive the loader with accelerate in your own loop"
            )

    def _run_epoch(self, *args: Any, **kwargs: Any):
        train_dataloader = kwargs.get("train_dataloader")
        if isinstance(train_dataloader, TrainerLoader):
            self._check_position(train_dataloader, kwargs)
        return super()._run_epoch(*args, **kwargs)

    def _check_position(self, view: TrainerLoader, kw: dict[str, Any]) -> None:
        try:
            epoch, first, resume, done = (
                kw["epoch"],
                kw["epochs_trained"],
                kw["resume_from_checkpoint"],
                kw["steps_trained_in_current_epoch"],
            )
        except KeyError as e:
            raise LoaderError(
                f"transformers {transformers.__version__} runs epochs with other arguments (no {e}); "
                f"ShardedTrainer cannot check the loader's position against it"
            ) from None
        resumed = epoch == first and resume is not None and not self.args.ignore_data_skip
        if not resumed:
            view.set_epoch(epoch)  # what the Trainer does next; a new epoch starts at its first batch
        expected = (epoch, done if resumed else 0)
        found = view.position()
        if found == expected:
            return
        raise LoaderError(
            f"the train loader is at epoch {found[0]}, batch {found[1]}, but the Trainer starts epoch {expected[0]} "
            f"at batch {expected[1]}: it would train on other batches than the interrupted run. Give ShardedTrainer "
            f"a fresh ShardedLoader of the same dataset and config, and resume with "
            f"train(resume_from_checkpoint=...) rather than load_state_dict by hand"
        )

    # ------------------------------------------------------------------ save
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        if self.args.should_save:  # where the Trainer writes trainer_state.json: once (per node if asked)
            folder = os.path.join(
                self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            )
            write_state(folder, self.train_loader.state_dict())


def write_state(checkpoint_dir: str, state: dict[str, Any]) -> None:
    """``state`` as ``checkpoint_dir/shardtool_loader.json``, atomically (a kill leaves the old file or none)."""
    path = os.path.join(checkpoint_dir, STATE_FILE)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(state, f)
    os.replace(tmp, path)


def read_state(checkpoint_dir: str) -> dict[str, Any]:
    path = os.path.join(checkpoint_dir, STATE_FILE)
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise LoaderStateError(
            f"{checkpoint_dir} has no {STATE_FILE}: it was not saved by ShardedTrainer, so the "
            f"loader's position is unknown. Pass TrainingArguments(ignore_data_skip=True) to start "
            f"the checkpoint's epoch over from its first batch"
        ) from None
    except ValueError as e:
        raise LoaderStateError(f"{path} is not a loader state ({e})") from None
