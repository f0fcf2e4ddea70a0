"""Whether every rank opened the same thing: one small all-reduce, and the message when they differ.

A rank on another dataset version, batching config or position would otherwise wait forever in
training's first collective after the others ran out of batches. The check runs once per epoch
(or per mixture run), only where torch.distributed is initialised with the loader's own layout.
"""

from __future__ import annotations

import hashlib

__all__ = ["disagreement", "in_process_group"]


def in_process_group(world_size: int, rank: int) -> bool:
    """torch.distributed is initialised with this layout (an explicit layout that is not the
    process group's has nobody to compare with)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    return dist.get_world_size() == world_size and dist.get_rank() == rank


def disagreement(rank: int, numbers: list[int], ident: str, what: str, fix: str) -> str | None:
    """All-reduce ``numbers`` and a digest of ``ident`` (MAX of them and of their negatives): the
    message naming the ranges if any rank differs, else None. Every rank must call it."""
    import torch
    import torch.distributed as dist

    digest = int(hashlib.sha256(ident.encode()).hexdigest()[:15], 16)
    mine = [numbers[0], digest, *numbers[1:]]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor(mine + [-x for x in mine], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    hi, neg_lo = t[: len(mine)].tolist(), t[len(mine) :].tolist()
    if all(h == -lo for h, lo in zip(hi, neg_lo)):
        return None
    return (
        f"rank {rank}: ranks disagree on {what}: this rank has {mine}; ranges across ranks "
        f"{list(zip([-x for x in neg_lo], hi))}. {fix}"
    )
