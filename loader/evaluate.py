"""Exact distributed evaluation: a per-sample metric summed over the valid entries of every rank.

An exact loader (``ShardedLoader(..., exact=True)``) serves each sample once in total and marks
the padding that evens the ranks' batch counts in ``batch["valid"]``. A metric averaged per rank
and then across ranks is still wrong (ranks hold different numbers of samples), so `ValidSum`
keeps a sum and a count and all-reduces both once, at the end: the result equals what one
process reading the whole dataset computes, on any number of ranks.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ValidSum"]


class ValidSum:
    """Sum and count of a metric's valid entries on this rank; `reduce` over all ranks.

    ``add(values, valid)``: ``values`` is one entry per sample (or per packed row), shape ``[B]``,
    or ``[B, ...]`` (each sample's entries all count); ``valid`` is the batch's mask. The sums
    stay on the values' device (no host sync per batch) in float64, so the order of additions,
    which differs with the number of ranks, changes the result only at float64 rounding."""

    def __init__(self) -> None:
        self._sum: torch.Tensor | None = None
        self._count: torch.Tensor | None = None

    def add(self, values: Any, valid: torch.Tensor) -> None:
        values = torch.as_tensor(values)
        valid = torch.as_tensor(valid, device=values.device).to(torch.bool)
        if values.shape[:1] != valid.shape:
            raise ValueError(
                f"values must have one entry per sample of the batch (first dimension {tuple(valid.shape)}), "
                f"found shape {tuple(values.shape)}"
            )
        kept = values[valid].to(torch.float64)
        if self._sum is None:
            self._sum = torch.zeros((), dtype=torch.float64, device=values.device)
            self._count = torch.zeros((), dtype=torch.float64, device=values.device)
        self._sum += kept.sum()
        self._count += kept.numel()

    def reduce(self, group: Any = None) -> tuple[float, int]:
        """(sum, count) over every rank of ``group`` (the default group; this rank's alone
        outside a process group). Collective: every rank must call it, as with any all-reduce;
        a rank that added nothing contributes zeros."""
        import torch.distributed as dist

        device = self._sum.device if self._sum is not None else _default_device(group)
        both = torch.zeros(2, dtype=torch.float64, device=device)
        if self._sum is not None:
            if self._count is None:
                raise RuntimeError("shardtool internal error: `add` sets both")
            both[0], both[1] = self._sum, self._count
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(both, group=group)
        total, count = both.tolist()
        return total, int(round(count))

    def mean(self, group: Any = None) -> float:
        """The metric's mean over every valid entry of every rank (nan where there is none)."""
        total, count = self.reduce(group)
        return total / count if count else float("nan")


def _default_device(group: Any) -> torch.device:
    """Where a rank that saw no batch keeps its zeros: NCCL all-reduces CUDA tensors only."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
