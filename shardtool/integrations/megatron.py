"""`ShardedLoader` as a Megatron-core training iterator (``--dataloader-type external``).

What Megatron's protocol needs, and nothing more (the position lives in the loader only):

* An iterator: with ``external``, Megatron passes what the datasets provider returns straight to
  its ``RerunDataIterator``, which calls ``next()`` once per micro-batch and never expects
  ``StopIteration`` (it counts iterations, not epochs). `MegatronIterator` runs epoch after epoch.
* Megatron's key names (``megatron.core.datasets.gpt_dataset``): ``tokens``, ``labels``,
  ``loss_mask`` (float), ``position_ids``. Megatron's ``labels`` are already shifted (``labels[i]``
  is the token after ``tokens[i]``) and so are ours: a packed row's ``labels[i]`` is the next
  token of the same document, -100 at a document's last token and on padding. So ``tokens`` is
  our ``input_ids``, ``loss_mask`` is 0 where our labels are -100, and ``labels`` has those -100
  set to 0 (as GPTDataset does: the embedding and loss kernels index the vocabulary with it).
* Packed rows add ``cu_seqlens`` (int32, the piece boundaries over the flattened batch, unused
  trailing entries repeat B*S: zero-length sequences) and ``max_seqlen`` (int32 tensor [1], as
  ``get_thd_batch_on_this_cp_rank`` reads ``max_seqlen[0]``): the arguments of
  ``PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
  max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)`` with the batch flattened to one row.
* Built where Megatron builds data: tensor-parallel rank 0 (Megatron broadcasts the batch to the
  other TP ranks in ``get_batch_on_this_tp_rank``), first and last pipeline stages (the middle
  ones read no data). Context-parallel peers share a DP rank, hence the same batch, which
  Megatron then slices per CP rank. The loader is built with ``dp_rank``/``dp_size``, so TP
  peers would get the same batches if built.
* ``save_state()`` / ``restore_state()``: Megatron's checkpointing with ``--dataloader-save``
  calls ``iterator.iterable.save_state()`` on TP rank 0 and writes one file per DP rank (which,
  named with pipeline rank 0, the stages overwrite: Megatron-LM PR #7413). Our state is the same
  on every rank, so ``save_state(folder)`` writes it once, from DP/TP/PP rank 0, atomically, as
  ``folder/shardtool_loader.json``, and every rank restores from that one file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..loader import LoaderStateError, ShardedLoader

__all__ = ["STATE_FILE", "MegatronIterator", "Ranks", "build_iterator", "megatron_ranks"]

STATE_FILE = "shardtool_loader.json"
IGNORE = -100  # our label on a document's last token and on padding


@dataclass(frozen=True)
class Ranks:
    """This process's place in Megatron's model-parallel grid, as far as data is concerned."""

    dp_rank: int
    dp_size: int
    tp_rank: int = 0
    pp_rank: int = 0
    pp_first: bool = True
    pp_last: bool = True

    @property
    def reads_data(self) -> bool:
        """Where Megatron builds and reads data: TP rank 0 of the first and last pipeline stages."""
        return self.tp_rank == 0 and (self.pp_first or self.pp_last)

    @property
    def saves(self) -> bool:
        """The one rank that writes the (rank-identical) state."""
        return self.dp_rank == 0 and self.tp_rank == 0 and self.pp_rank == 0


def megatron_ranks(dp_rank: int | None = None, dp_size: int | None = None, tp_rank: int | None = None) -> Ranks:
    """The ranks from ``megatron.core.parallel_state`` if it is initialised, else the arguments."""
    explicit = (dp_rank, dp_size, tp_rank)
    try:
        from megatron.core import parallel_state as ps

        ready = ps.model_parallel_is_initialized()
    except ImportError:
        ready = False
    if ready:
        # get_data_parallel_rank() leaves context parallelism out: CP peers read the same batch
        got = Ranks(
            ps.get_data_parallel_rank(),
            ps.get_data_parallel_world_size(),
            ps.get_tensor_model_parallel_rank(),
            ps.get_pipeline_model_parallel_rank(),
            ps.is_pipeline_first_stage(ignore_virtual=True),
            ps.is_pipeline_last_stage(ignore_virtual=True),
        )
        given = {k: v for k, v in zip(("dp_rank", "dp_size", "tp_rank"), explicit) if v is not None}
        wrong = {k: v for k, v in given.items() if getattr(got, k) != v}
        if wrong:
            raise ValueError(
                f"megatron.core.parallel_state says {', '.join(f'{k}={getattr(got, k)}' for k in wrong)}, "
                f"but {', '.join(f'{k}={v}' for k, v in wrong.items())} was passed: leave them out"
            )
        return got
    if dp_rank is None or dp_size is None:
        raise ValueError(
            "megatron.core.parallel_state is not initialised: pass dp_rank= and dp_size= (and tp_rank=), "
            "or call build_iterator after Megatron's initialize_megatron()"
        )
    return Ranks(int(dp_rank), int(dp_size), int(tp_rank or 0))


class MegatronIterator:
    """A `ShardedLoader` as Megatron's external train iterator (see the module docstring)."""

    def __init__(self, loader: ShardedLoader, ranks: Ranks):
        if not isinstance(loader, ShardedLoader):
            raise TypeError(f"MegatronIterator wraps a ShardedLoader, found {type(loader).__name__}")
        self.loader = loader
        self.ranks = ranks
        self._it: Iterator[Any] | None = None

    def __iter__(self) -> MegatronIterator:
        return self

    def __next__(self) -> dict[str, Any]:
        for _ in range(2):  # an exhausted epoch is followed by the next one's first batch
            if self._it is None:
                self._it = iter(self.loader)
            try:
                return to_megatron(next(self._it))
            except StopIteration:
                self._it = None
        raise StopIteration  # an epoch with no batch for this rank: nothing to train on

    # ------------------------------------------------------------------ state
    def save_state(self, folder: str | os.PathLike | None = None) -> dict[str, Any]:
        """The loader's state (the same on every rank). With ``folder``, DP/TP/PP rank 0 also writes it
        there as ``shardtool_loader.json``, atomically; the other ranks write nothing."""
        state = self.loader.state_dict()
        if folder is not None and self.ranks.saves:
            write_state(os.fspath(folder), state)
        return state

    def restore_state(self, source: Any) -> None:
        """Continue from a state: the dict `save_state` returned, the folder it wrote, the file in it, or
        what Megatron's ``--dataloader-save`` wrote (``{"dataloader_state_dict": state}``)."""
        state = source
        if isinstance(source, (str, os.PathLike)):
            state = read_state(os.fspath(source))
        if isinstance(state, dict) and "dataloader_state_dict" in state:
            state = state["dataloader_state_dict"]
        if not isinstance(state, dict):
            raise LoaderStateError(
                f"cannot restore from a {type(state).__name__}: pass the dict save_state() returned "
                f"or the folder it wrote"
            )
        self.loader.load_state_dict(state)
        self._it = None  # the next batch is the restored position's

    def close(self) -> None:
        self.loader.close()


def to_megatron(batch: dict[str, Any]) -> dict[str, Any]:
    """Our batch under Megatron's names (the module docstring says how labels map)."""
    import torch

    labels = batch["labels"]
    ignored = labels == IGNORE
    out = {
        "tokens": batch["input_ids"],
        "labels": labels.masked_fill(ignored, 0),
        "loss_mask": (~ignored).to(torch.float32),
        "position_ids": batch["position_ids"],
    }
    if "cu_seqlens" in batch:
        out["cu_seqlens"] = batch["cu_seqlens"].to(torch.int32)
        out["max_seqlen"] = torch.tensor([int(batch["max_seqlen"])], dtype=torch.int32)
    return out


def build_iterator(
    url: Any,
    *,
    seq_len: int,
    batch_size: int,
    dp_rank: int | None = None,
    dp_size: int | None = None,
    tp_rank: int | None = None,
    everywhere: bool = False,
    restore: Any = None,
    **loader_kwargs: Any,
) -> MegatronIterator | None:
    """A `MegatronIterator` of packed rows where Megatron reads data, None elsewhere (``everywhere=True``:
    on every rank). Ranks from ``megatron.core.parallel_state`` if initialised, else the arguments.
    ``restore``: a state or the folder `save_state` wrote (missing folder: start afresh)."""
    ranks = megatron_ranks(dp_rank, dp_size, tp_rank)
    if not (everywhere or ranks.reads_data):
        return None
    if everywhere or _every_rank_builds(ranks):
        # every process holds a loader: the loader's once-an-epoch check that all ranks agree runs
        # over the whole process group, and the DP layout is taken within it
        placement = {"dp_rank": ranks.dp_rank, "dp_size": ranks.dp_size}
    else:
        # only TP rank 0 (of the data-reading stages) holds one: a collective over the whole group
        # would wait forever for the ranks that hold none, so the loader's world is the DP ranks
        # alone (one node group unless ranks_per_node= is given; the batches are the same)
        placement = {"rank": ranks.dp_rank, "world_size": ranks.dp_size, "ranks_per_node": ranks.dp_size}
    placement.update({k: loader_kwargs.pop(k) for k in ("ranks_per_node",) if k in loader_kwargs})
    loader = ShardedLoader(url, batch_size=batch_size, seq_len=seq_len, **placement, **loader_kwargs)
    it = MegatronIterator(loader, ranks)
    if restore is not None and not (isinstance(restore, (str, os.PathLike)) and not os.path.exists(restore)):
        try:
            it.restore_state(restore)
        except BaseException:
            loader.close()
            raise
    return it


def _every_rank_builds(ranks: Ranks) -> bool:
    """No TP, PP or CP: each process of the group is a DP rank of its own."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() == ranks.dp_size


def write_state(folder: str, state: dict[str, Any]) -> str:
    """``state`` as ``folder/shardtool_loader.json``; a kill leaves the old file or none, never half of one."""
    path = os.path.join(folder, STATE_FILE)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        os.makedirs(folder, exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(state, f)
        os.replace(tmp, path)
    except OSError as e:
        raise OSError(e.errno, f"cannot save the loader state to {path}: {e.strerror}") from None
    return path


def read_state(source: str) -> dict[str, Any]:
    path = os.path.join(source, STATE_FILE) if os.path.isdir(source) else source
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise LoaderStateError(f"{path} does not exist: no loader state was saved there") from None
    except ValueError as e:
        raise LoaderStateError(f"{path} is not a loader state ({e})") from None
