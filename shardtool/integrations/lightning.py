"""`ShardedLoader` as a PyTorch Lightning ``train_dataloader`` / ``val_dataloader``.

What Lightning's protocol needs, and nothing more (the position lives in the loader only):

* ``len()``: Lightning restores its batch counter (``batch_progress``) from the checkpoint, to the
  batches already done this epoch, and ends the epoch when that counter reaches ``len()``: the
  *whole* epoch (batches of earlier layout segments of this epoch + this segment's), which is
  what ``len(ShardedLoader)`` reports, after a resume too.
* ``state_dict`` / ``load_state_dict`` (Lightning's ``_Stateful``): Lightning saves them in
  ``loops.fit_loop.state_dict.combined_loader`` and loads them before the first batch.
* ``iter()`` is lazy: Lightning calls ``iter()`` to test that the object is iterable, and again
  before it restores the state or calls ``set_epoch``; the pass is decided at the first batch.
* ``sampler.set_epoch``: Lightning calls it on ``dataloader.sampler`` at every epoch start (and
  before every validation run) with its own epoch, so the loader's epoch follows the trainer's.
* A pass this view left unfinished (Lightning's sanity check, ``limit_*_batches``) is not
  continued by the next one: that starts its epoch afresh, as a ``DataLoader`` would. A position
  loaded with ``load_state_dict`` (or the loader's own when wrapped) is continued.

A bare ShardedLoader returned from ``train_dataloader()`` resumes exactly too (its ``len()`` and
lazy ``iter()`` are the same), but follows its own epochs: a pass Lightning cuts short is
continued by the next epoch, and Lightning's ``set_epoch`` is not seen.

`ShardedLoaderCallback` guards what Lightning can get wrong: reading
``trainer.estimated_stepping_batches`` in ``configure_optimizers`` (an LR schedule) makes
Lightning build the train loader before it has read the checkpoint, and it then never restores
the loader's position (Lightning issue #20550). The callback restores it, checks at the first
batch of every fit that the loader's position is Lightning's step in its epoch, and after a resume
on another number of ranks has Lightning re-read ``len()`` every epoch (it reads it once per fit).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

try:  # the unified package; the standalone one has the same classes under another name
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover - depends on what is installed
    import pytorch_lightning as pl  # type: ignore[no-redef]

from ..loader import LoaderError, ShardedLoader
from .position import one_dataset, position

__all__ = ["LightningLoader", "ShardedLoaderCallback"]

log = logging.getLogger(__name__)


class _Epochs:
    """What Lightning finds at ``dataloader.sampler``: it calls ``set_epoch`` there and nowhere else."""

    def __init__(self, view: LightningLoader):
        self._view = view

    def set_epoch(self, epoch: int) -> None:
        self._view.loader.set_epoch(epoch)


class LightningLoader:
    """A `ShardedLoader` as Lightning expects a dataloader (see the module docstring for why).

    Return it from ``train_dataloader()`` (``shuffle=True``) or ``val_dataloader()``
    (``shuffle=False, drop_last=False``: every validation run serves each sample once). Build the
    ShardedLoader in a hook (``setup``, ``*_dataloader``), where Lightning has started the process
    group: built before ``trainer.fit``, it cannot know its rank.
    """

    batch_sampler = None  # Lightning reads it beside ``sampler``; there is none

    def __init__(self, loader: ShardedLoader):
        self.loader = one_dataset(loader, "LightningLoader", "LightningLoader follows Lightning's epochs")
        self.sampler = _Epochs(self)
        self._loaded = False  # a state was loaded since the last pass began: the next pass continues it
        self._started = False  # a pass of this view has begun (so a mid-epoch position may be ours, cut short)

    # ------------------------------------------------------------------ Lightning's _Stateful
    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)
        self._loaded = True

    @property
    def restored(self) -> bool:
        """A state was loaded and the next pass will continue from it."""
        return self._loaded

    # ------------------------------------------------------------------ position and length
    def position(self) -> tuple[int, int]:
        """(epoch, batches this rank has had in it): where the next batch comes from."""
        return position(self.loader)

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def epoch_batches(self) -> int:
        """Batches of a whole epoch on this layout. ``len()`` differs only in an epoch resumed on
        another DP size (its earlier segments had other counts)."""
        return _whole_epoch(self.loader)

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[Any]:
        return self._pass()

    def _pass(self) -> Iterator[Any]:
        # A generator: none of this runs before Lightning asks for the first batch, after it has
        # restored the state and called set_epoch.
        self._check_rank()
        if self._started and not self._loaded:
            self._rewind()
        self._started, self._loaded = True, False
        yield from self.loader

    def _rewind(self) -> None:
        """Start the loader's current epoch from its first batch (a pass of ours stopped mid-epoch)."""
        epoch, done = self.position()
        if done:
            # set_epoch keeps the position within the current epoch; through another epoch and
            # back it starts afresh (planning is lazy: the step plans nothing).
            self.loader.set_epoch(epoch + 1)
            self.loader.set_epoch(epoch)

    def _check_rank(self) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        world, rank = dist.get_world_size(), dist.get_rank()
        if (self.loader.layout.world_size, self.loader.rank) != (world, rank):
            raise LoaderError(
                f"this ShardedLoader was built for rank {self.loader.rank} of {self.loader.layout.world_size}, but "
                f"Lightning runs it on rank {rank} of {world}: build it inside the LightningModule's or "
                f"DataModule's setup() or *_dataloader() hook, after Lightning has started the process group, "
                f"not before trainer.fit()"
            )

    def close(self) -> None:
        self.loader.close()


def _views(loaders: Any) -> list[Any]:
    """Lightning's stateful train loaders, in the order its checkpoint lists their states."""
    flat = pl.utilities.CombinedLoader(loaders).flattened if loaders is not None else []
    # Lightning's test (its _Stateful protocol): both methods present
    return [
        dl
        for dl in flat
        if callable(getattr(dl, "state_dict", None)) and callable(getattr(dl, "load_state_dict", None))
    ]


def _ours(view: Any) -> bool:
    return isinstance(view, (LightningLoader, ShardedLoader))


def _restored(view: LightningLoader | ShardedLoader) -> bool:
    """A state was loaded into it and its next pass will continue from there."""
    return view.restored if isinstance(view, LightningLoader) else view.resuming


def _epoch_loader(view: Any) -> ShardedLoader | None:
    """The one-dataset loader behind a train loader (a LightningLoader's, or a bare one), whose
    epochs follow Lightning's; None for anything else (a mixture has no epochs)."""
    loader = view.loader if isinstance(view, LightningLoader) else view
    return loader if isinstance(loader, ShardedLoader) and loader.mixture is None else None


def _whole_epoch(loader: ShardedLoader) -> int:
    """Batches of a whole epoch on the loader's layout: ``len()`` differs only in an epoch resumed
    on another DP size (its earlier segments had other counts)."""
    return loader.planner.shape(loader.data_layout).batches_per_rank


class ShardedLoaderCallback(pl.Callback):
    """Restores the train loader's position where Lightning skipped it (#20550), and checks it.

    ``Trainer(callbacks=[ShardedLoaderCallback()])``, with a `LightningLoader` or a bare
    `ShardedLoader` as the train loader. At the first batch of a fit it raises a `LoaderError` if
    the loader is not at Lightning's step in Lightning's epoch, whatever the cause, rather than
    train on batches the resumed run should not see.
    """

    def __init__(self) -> None:
        self._saved: list[dict] | None = None
        self._check_next_batch = False

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        fit = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
        self._saved = fit.get("combined_loader") or None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check_next_batch = True
        views = _views(trainer.train_dataloader)
        self._restore(views)
        loaders = [ld for ld in map(_epoch_loader, views) if ld is not None]
        if any(len(ld) != _whole_epoch(ld) for ld in loaders):
            # Resumed on another number of ranks: this epoch is (batches before) + (its rest re-dealt),
            # later ones are whole epochs on the new layout. Lightning reads len() once per fit and
            # would end every later epoch at this one's length; re-reading it each epoch costs a
            # train_dataloader() call (the same loader, if the hook returns it).
            if trainer.reload_dataloaders_every_n_epochs != 1:
                log.info(
                    "resumed on another number of ranks: Lightning re-reads the train loader's length every "
                    "epoch (reload_dataloaders_every_n_epochs=1) so that later epochs are whole"
                )
                trainer.reload_dataloaders_every_n_epochs = 1

    def _restore(self, views: list) -> None:
        saved, self._saved = self._saved, None
        if not saved or len(views) != len(saved):
            return  # Lightning itself refuses a checkpoint whose loaders do not match, with a message
        for view, state in zip(views, saved):
            if not _ours(view) or _restored(view):
                continue
            view.load_state_dict(state)
            if state.get("kind") == "mixture" or any(s.get("served") for s in state.get("segments", [])):
                log.warning(
                    "Lightning did not restore the train loader's position from the checkpoint (it "
                    "built the loader before reading the checkpoint, as when configure_optimizers reads "
                    "trainer.estimated_stepping_batches: Lightning issue #20550); ShardedLoaderCallback "
                    "restored it: %s",
                    _where(state),
                )

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._check_next_batch:
            return
        self._check_next_batch = False
        for view in _views(trainer.train_dataloader):
            loader = _epoch_loader(view)
            if loader is not None:
                self._check(loader, trainer.current_epoch, batch_idx, trainer.num_training_batches)

    @staticmethod
    def _check(loader: ShardedLoader, epoch: int, batch_idx: int, epoch_end: float) -> None:
        # The batch at hand is served: the loader is after it, which at the end of an epoch (the
        # loader's, and Lightning's) is the start of the next one.
        done = batch_idx + 1
        found = position(loader)
        if found != (epoch, done) and not (found == (epoch + 1, 0) and done >= epoch_end):
            raise LoaderError(
                f"the train loader is at epoch {found[0]}, batch {found[1]}, but Lightning is at epoch {epoch}, "
                f"batch {done}: the resumed run would train on other batches than the interrupted one. Return the "
                f"same loader from train_dataloader() (built once, in setup()), and let Lightning's "
                f"checkpoint (trainer.fit(ckpt_path=...)) restore it rather than load_state_dict by hand"
            )


def _where(state: dict) -> str:
    if state.get("kind") == "mixture":
        return f"step {state.get('step')}"
    return f"epoch {state.get('epoch')}, batch {sum(s.get('served', 0) for s in state.get('segments', []))}"
