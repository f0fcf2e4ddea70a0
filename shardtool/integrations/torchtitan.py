"""`ShardedLoader` as the dataloader of a torchtitan trainer, saved in torchtitan's own checkpoints.

What torchtitan's protocol needs, and nothing more (the position lives in the loader only):

* ``state_dict`` / ``load_state_dict`` (``torch.distributed.checkpoint.stateful.Stateful``, what
  ``BaseDataLoader`` enforces): torchtitan's ``CheckpointManager`` saves the dataloader under the
  key ``"dataloader"`` with ``torch.distributed.checkpoint`` (DCP) and loads it with a plain
  ``dcp.load``, which calls ``state_dict()`` for the keys to read and then ``load_state_dict``.
* The state is keyed like torchtitan's ``ParallelAwareDataloader`` (``{"dp_rank_<r>": ...,
  "world_size": <DP size>}``) but every rank uses DP rank 0's key. Our state is the same on every
  rank, so DCP writes it once; and a key of this rank's own would be missing from a checkpoint
  saved on fewer DP ranks, which that ``dcp.load`` refuses ("Missing key in checkpoint
  state_dict") before the loader is asked. Read from one entry, `ShardedLoader.load_state_dict`
  re-deals the rest of the epoch over this run's DP size: a resume on another DP size works, where
  torchtitan's own loader refuses it (torchtitan #811).
* Built by torchtitan's trainer from its config: ``ShardedTitanDataLoader.Config`` is a
  ``BaseDataLoader.Config``, and the trainer's ``config.dataloader.build(dp_rank=, dp_world_size=,
  seq_len=, local_batch_size=, ...)`` gives the ShardedLoader its DP coordinates and batch shape.
* Iteration yields ``(input_dict, labels)``, what torchtitan's ``batch_generator`` unpacks, from
  one stream over epochs: torchtitan counts steps, not epochs, and calls ``iter()`` once per fit.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from torchtitan.components.dataloader import BaseDataLoader

from ..loader import LoaderStateError, ShardedLoader

__all__ = ["STATE_KEY", "ShardedTitanDataLoader", "TitanLoader", "next_token_split"]

log = logging.getLogger(__name__)

STATE_KEY = "dp_rank_0"


def next_token_split(batch: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """``({"input": tokens[:, :-1]}, tokens[:, 1:])`` of packed rows, as torchtitan's text datasets
    yield them: build the ShardedLoader with ``seq_len`` = torchtitan's ``seq_len + 1``."""
    ids = batch["input_ids"]
    return {"input": ids[:, :-1]}, ids[:, 1:]


class TitanLoader:
    """A `ShardedLoader` as torchtitan expects its dataloader (see the module docstring).

    Build the ShardedLoader with torchtitan's DP coordinates (``dp_rank=``, ``dp_size=``: from
    ``parallel_dims``' ``dp`` mesh), so that TP/PP ranks of one DP rank get the same batches.
    ``split`` turns a batch into ``(input_dict, labels)``; ``epochs`` ends the stream when the loader
    reaches that epoch, also after a resume (None: endless, as torchtitan's own datasets with ``infinite=True``).
    """

    def __init__(
        self,
        loader: ShardedLoader,
        *,
        split: Callable[[dict], tuple[dict, Any]] = next_token_split,
        epochs: int | None = None,
    ):
        if not isinstance(loader, ShardedLoader):
            raise TypeError(f"TitanLoader wraps a ShardedLoader, found {type(loader).__name__}")
        if epochs is not None and loader.mixture is not None:
            raise TypeError(
                "a ShardedLoader of a Mixture has no epochs: leave TitanLoader's epochs=None and stop at "
                "torchtitan's training.steps"
            )
        self.loader = loader
        self.split = split
        self.epochs = epochs

    # ------------------------------------------------------------------ Stateful (DCP)
    def state_dict(self) -> dict[str, Any]:
        # A JSON string, not the dict: DCP flattens nested dicts and lists into one key each, and
        # the keys read on load must all exist in the checkpoint (the segment lists differ by then).
        return {
            STATE_KEY: json.dumps(self.loader.state_dict(), sort_keys=True),
            "world_size": self.loader.data_layout.dp_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get(STATE_KEY) if isinstance(state, dict) else None
        if isinstance(saved, (bytes, bytearray)):
            raise LoaderStateError(
                "the checkpoint's dataloader state was saved by torchtitan's own ParallelAwareDataloader, not by "
                "shardtool's TitanLoader: start the data afresh with checkpoint.exclude_from_loading=['dataloader']"
            )
        if not isinstance(saved, str):
            raise LoaderStateError(
                f"the checkpoint's dataloader state has no shardtool entry ({STATE_KEY!r}); found keys "
                f"{sorted(state) if isinstance(state, dict) else type(state).__name__}: start the data afresh "
                f"with checkpoint.exclude_from_loading=['dataloader']"
            )
        saved_dp = state.get("world_size")
        if saved_dp is not None and saved_dp != self.loader.data_layout.dp_size:
            log.info(
                "resuming a state saved on %s DP ranks on %d: the rest of the epoch is re-dealt",
                saved_dp,
                self.loader.data_layout.dp_size,
            )
        self.loader.load_state_dict(json.loads(saved))

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[tuple[dict[str, Any], Any]]:
        # The loader's next iter() after an epoch's last batch starts the next epoch (docs/architecture.md §5);
        # a mixture's one iter() is already endless.
        empty = 0
        while self.epochs is None or self.loader.state_dict()["epoch"] < self.epochs:
            served = False
            for batch in self.loader:
                served = True
                yield self.split(batch)
            if self.loader.mixture is not None:
                return
            # A resumed epoch may leave this rank nothing (the re-deal's leftover), never two in a row
            empty = 0 if served else empty + 1
            if empty == 2:
                return

    def close(self) -> None:
        self.loader.close()


class ShardedTitanDataLoader(TitanLoader, BaseDataLoader):
    """`TitanLoader` as torchtitan's trainer builds a dataloader: ``config.dataloader =
    ShardedTitanDataLoader.Config(dataset_path=url, options={...})``.

    The trainer passes its DP rank and size, ``seq_len`` and ``local_batch_size``; ``options`` are
    further `ShardedLoader` keyword arguments (``num_workers``, ``seed``, ``cache_dir``, ...). Rows
    are packed to ``seq_len + 1`` tokens, split into input and next-token labels.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        options: dict[str, Any] = field(default_factory=dict)
        """`ShardedLoader` keyword arguments other than the url, DP coordinates and batch shape."""

    def __init__(
        self,
        config: ShardedTitanDataLoader.Config,
        *,
        dp_rank: int,
        dp_world_size: int,
        seq_len: int,
        local_batch_size: int,
        **_trainer_kwargs: Any,
    ):
        # _trainer_kwargs: what the trainer passes every dataloader and we do not use (tokenizer:
        # the shards are tokenized at pack time; snapshot_every_n_steps: our state is always small)
        if not config.dataset_path:
            raise ValueError("ShardedTitanDataLoader.Config needs dataset_path: the packed dataset's url")
        taken = {"url", "dp_rank", "dp_size", "seq_len", "batch_size"} & set(config.options)
        if taken:
            raise ValueError(
                f"ShardedTitanDataLoader.Config.options sets {sorted(taken)}, which torchtitan's trainer "
                f"passes (dataset_path, DP rank and size, training.seq_len, training.local_batch_size)"
            )
        loader = ShardedLoader(
            config.dataset_path,
            batch_size=local_batch_size,
            seq_len=seq_len + 1,
            dp_rank=dp_rank,
            dp_size=dp_world_size,
            **config.options,
        )
        super().__init__(loader)
