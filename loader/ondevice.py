"""What a trainer derives from a packed batch on its own device (after the copy to the GPU): the
full batch of a lean one (`lean_to_full`), a block-causal attention mask (`block_causal_mask`)
and what a cost model prices in it (`cost_terms`, to calibrate one).
Re-exported by `shardtool.loader.packed`, where users find them."""

from __future__ import annotations

from typing import Any

import torch

from .tokenfields import LABELS, LOSS_MASK

__all__ = ["IGNORE_INDEX", "block_causal_mask", "cost_terms", "lean_to_full"]

IGNORE_INDEX = -100  # what torch.nn.functional.cross_entropy ignores by default


def block_causal_mask(batch: dict[str, Any]) -> torch.Tensor:
    """Bool [B, 1, S, S] for ``scaled_dot_product_attention(attn_mask=...)``: True where query i
    may attend to key j (same piece of ``cu_seqlens``, j <= i). B * S * S bytes: for long rows,
    use varlen attention with ``cu_seqlens`` instead."""
    b, seq = batch["position_ids"].shape
    cu = batch["cu_seqlens"].to(torch.int64)
    segment = torch.searchsorted(cu, torch.arange(b * seq, device=cu.device), right=True).view(b, seq)
    pos = torch.arange(seq, device=cu.device)
    causal = pos[None, :] <= pos[:, None]
    return ((segment[:, :, None] == segment[:, None, :]) & causal)[:, None]


def cost_terms(batch: dict[str, Any]) -> tuple[int, int]:
    """(tokens, squares) of a packed batch, full or lean, as a cost model prices it
    (`shardtool.plan.cost`): every row's ``seq_len`` tokens (the linear layers run on padding too)
    and the sum of its pieces' squared real lengths (``cu_seqlens`` folds a row's padding into its
    last piece: left out here). What `shardtool.plan.cost.fit_cost_model` takes per timed batch."""
    cu = batch["cu_seqlens"].to(torch.int64).cpu()
    real = batch["lengths"].to(torch.int64).cpu()
    rows = int(real.numel())
    seq = int(cu[-1]) // max(rows, 1)
    starts, ends = cu[:-1], cu[1:]
    used = starts < rows * seq  # unused entries repeat B * S
    starts, ends = starts[used], ends[used]
    real_end = (starts // seq) * seq + real[starts // seq]  # where each piece's row stops being real
    pieces = (torch.minimum(ends, real_end) - starts).clamp(min=0)
    return rows * seq, int((pieces * pieces).sum())


def lean_to_full(batch: dict[str, Any], *, name: str = "input_ids") -> dict[str, Any]:
    """The full batch of a lean one, computed where its tensors are (on the GPU after the copy):
    ``name`` widened to int64, ``labels`` and ``position_ids`` (int64) added, equal to what
    ``outputs="full"`` builds (less ``__key__``). Labels: the next token where it is in the same
    piece (a segment of ``cu_seqlens``) and the row's real tokens (``lengths``), else -100.
    Per-token fields (`shardtool.loader.tokenfields`): a stored ``labels`` (unshifted) gives the
    targets instead of the tokens, and ``loss_mask`` sets -100 where the predicted token's mask is 0."""
    ids = batch[name]
    b, seq = ids.shape
    n = b * seq
    dev = ids.device
    flat = ids.reshape(-1).to(torch.int64)
    cu = batch["cu_seqlens"].to(device=dev, dtype=torch.int64)
    at = torch.arange(n, device=dev)
    positions = at - cu[torch.searchsorted(cu, at, right=True) - 1]
    target = batch[LABELS].to(device=dev, dtype=torch.int64).reshape(-1) if LABELS in batch else flat
    labels = torch.full_like(flat, IGNORE_INDEX)
    labels[:-1] = target[1:]
    if LOSS_MASK in batch:
        labels[:-1][batch[LOSS_MASK].to(dev).reshape(-1)[1:] == 0] = IGNORE_INDEX
    if "image_mask" in batch:  # an image position is never a target (loader/imagerows.py)
        labels[:-1][batch["image_mask"].to(dev).reshape(-1)[1:]] = IGNORE_INDEX
    # A piece's last token (its segment's end; repeated entries B * S name the last token, whose
    # label is -100 anyway), and from a row's last real token on: padding is no next token.
    labels[(cu[1:] - 1).clamp(min=0)] = IGNORE_INDEX
    real = batch["lengths"].to(device=dev, dtype=torch.int64)
    labels.view(b, seq)[torch.arange(seq, device=dev)[None, :] >= real[:, None] - 1] = IGNORE_INDEX
    return {
        **batch,
        name: flat.view(b, seq),
        "labels": labels.view(b, seq),
        "position_ids": positions.view(b, seq),
    }
