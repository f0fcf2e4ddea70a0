"""The loader's keywords checked and turned into what it runs with, in one place.

`ShardedLoader` keeps its explicit keywords (the public API); every check of them, and the
`Batching` they make, live here, as pure functions of the keywords, so a wrong combination is
refused before any file is opened and each rule is stated once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..plan import Batching
from ..plan.cost import CostModel
from ..plan.packing import Packing
from ..plan.schedule import Schedule, budget_schedule, parse_schedule, with_seq_lens

__all__ = ["BatchOptions", "WorkerOptions", "batch_options", "mixture_batching", "worker_options"]

PACKED_OUTPUTS = ("full", "lean")


@dataclass(frozen=True)
class WorkerOptions:
    """How batches are read: worker processes, their prefetch, pinning and timeout."""

    num_workers: int
    prefetch_factor: int
    pin_memory: bool
    timeout: float


@dataclass(frozen=True)
class BatchOptions:
    """What a batch is: the plan's batching config (its packing included), the packed outputs,
    and the per-sample transform, collate function and padding id of unpacked batches."""

    batching: Batching
    packed_outputs: str
    transform: Callable | None
    collate_fn: Callable | None
    pad_id: int
    token_fields: tuple[str, ...] | None = None  # None: every per-token array field (loader/tokenfields.py)
    schedule: Schedule | None = None  # batch_size or seq_len by step: the plan's batch_size is its base

    @property
    def packing(self) -> Packing | None:
        return self.batching.packing


def worker_options(num_workers: Any, prefetch_factor: Any, pin_memory: bool | None, timeout: float) -> WorkerOptions:
    """``pin_memory=None``: pin where CUDA is available."""
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"num_workers must be an int >= 0, found {num_workers!r}")
    if num_workers and (not isinstance(prefetch_factor, int) or prefetch_factor < 1):
        raise ValueError(f"prefetch_factor must be an int >= 1, found {prefetch_factor!r}")
    if pin_memory is None:
        import torch

        pin_memory = torch.cuda.is_available()
    return WorkerOptions(num_workers, prefetch_factor, bool(pin_memory), float(timeout))


def batch_options(
    *,
    batch_size: int | Mapping[int, int] | None,
    max_tokens: int | Mapping[int, int] | None,
    shuffle: bool,
    seed: int,
    window: int | None,
    bucketing: bool | None,
    seq_len: int | Mapping[int, int] | None,
    packing: str,
    eos_id: int | None,
    max_docs_per_row: int | None,
    packed_outputs: str,
    drop_last: bool | None,
    cost_model: Any,
    balance_window: int | None,
    micro_batches: int | None,
    shuffle_block: int | None,
    transform: Callable | None,
    exact: bool = False,
    collate_fn: Callable | None,
    pad_id: int,
    token_fields: Any = None,
) -> BatchOptions:
    """The batching of the loader's keywords (`Batching` checks its own fields); ValueError naming
    the keyword where a combination cannot work. ``bucketing=None`` stays None: the dataset
    decides it once opened (`shardtool.plan.batching.default_bucketing`)."""
    if isinstance(max_tokens, Mapping):
        schedule, max_tokens = _budgets(max_tokens, batch_size, seq_len, exact)
        rows_or_samples, row_len = None, None  # (_budgets refuses either given)
    else:
        schedule, rows_or_samples, row_len = _schedule(batch_size, seq_len, exact)
    rows = None
    if row_len is not None:
        if transform is not None or collate_fn is not None:
            raise ValueError(
                "packing builds its own batches: transform and collate_fn are not supported with "
                "seq_len (pack the transformed tokens instead)"
            )
        rows = Packing(row_len, packing, eos_id=eos_id, max_docs_per_row=max_docs_per_row)
    if packed_outputs not in PACKED_OUTPUTS:
        raise ValueError(f"packed_outputs must be 'full' or 'lean', found {packed_outputs!r}")
    if packed_outputs == "lean" and seq_len is None:
        raise ValueError("packed_outputs='lean' is for packed rows: give seq_len (and batch_size rows)")
    if token_fields is not None:
        if seq_len is None:
            raise ValueError(
                "token_fields chooses the per-token fields of packed rows: give seq_len (unpacked "
                "batches carry every field)"
            )
        if isinstance(token_fields, str) or not all(isinstance(f, str) for f in token_fields):
            raise ValueError(f"token_fields must be a list of field names, found {token_fields!r}")
        token_fields = tuple(token_fields)
    batching = Batching(
        batch_size=rows_or_samples,
        max_tokens=max_tokens,
        shuffle=shuffle,
        seed=seed,
        window=window,
        bucketing=bucketing,
        packing=rows,
        drop_last=drop_last,
        balance=CostModel.parse(cost_model) if cost_model is not None else None,
        balance_window=balance_window,
        micro_batches=micro_batches,
        shuffle_block=shuffle_block,
        exact=exact,
    )
    return BatchOptions(batching, packed_outputs, transform, collate_fn, int(pad_id), token_fields, schedule)


def mixture_batching(url: Any, batch_size: Any, seq_len: Any, max_tokens: Any) -> tuple[Any, Any, Any]:
    """(batch_size, seq_len, max_tokens): as given, completed by a mixture's own
    (`shardtool.plan.mixture.Mixture.batching_args`) where ``url`` is one."""
    from ..plan.mixture import Mixture

    if not isinstance(url, Mixture):
        return batch_size, seq_len, max_tokens
    got = url.batching_args(batch_size=batch_size, seq_len=seq_len, max_tokens=max_tokens)
    return got["batch_size"], got["seq_len"], got["max_tokens"]


def _budgets(max_tokens: Mapping, batch_size: Any, seq_len: Any, exact: bool) -> tuple[Schedule | None, int]:
    """``max_tokens={first step: budget}``: the schedule and the plan's budget (the smallest)."""
    if batch_size is not None or seq_len is not None:
        raise ValueError(
            "max_tokens by step ramps bucketed batches' token budget: give it without batch_size and seq_len "
            "(packed rows ramp with batch_size={first step: rows})"
        )
    schedule = budget_schedule(max_tokens)
    if len(schedule.changes) == 1:
        return None, schedule.changes[0][1]
    if exact:
        raise ValueError("max_tokens by step (a schedule) cannot be combined with exact=True yet; give one budget")
    return schedule, schedule.base


def _schedule(batch_size: Any, seq_len: Any, exact: bool) -> tuple[Schedule | None, Any, Any]:
    """``batch_size={first step: size}`` and ``seq_len={first step: length}``: the schedule, the
    plan's batch size (its base) and the plan's seq_len (the longest)."""
    sizes = parse_schedule("batch_size", batch_size) if isinstance(batch_size, Mapping) else None
    lengths = parse_schedule("seq_len", seq_len) if isinstance(seq_len, Mapping) else None
    if lengths is not None and batch_size is None:
        raise ValueError("seq_len by step needs batch_size: the rows per step (one size, or by step)")
    if lengths is not None and len(lengths.changes) == 1:
        seq_len, lengths = lengths.changes[0][1], None
    if sizes is not None and len(sizes.changes) == 1:
        batch_size, sizes = sizes.changes[0][1], None
    if sizes is None and lengths is None:
        return None, batch_size, seq_len
    what = "batch_size" if lengths is None else "seq_len"
    if exact:
        raise ValueError(f"{what} by step (a schedule) cannot be combined with exact=True yet; give one size")
    if lengths is None:
        return (sizes, sizes.base, seq_len) if sizes is not None else (None, batch_size, seq_len)
    schedule = with_seq_lens(sizes if sizes is not None else batch_size, lengths)
    return schedule, schedule.base, schedule.row_len
