"""The default batch, and how large payloads cross from a worker to the trainer.

Default batch: ``__key__`` (list of keys); the length field, when it is a 1-D integer array,
as a padded ``LongTensor [B, L]`` (padded with ``pad_id``) plus ``lengths [B]`` (elements per
row); otherwise only ``lengths`` (from the index); every other field stacked where it stacks, as
torch's ``default_collate`` does (:func:`stack_column`), else as a list of decoded values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

KEY = "__key__"
# Bytes fields whose batch total is above this travel as one block of the worker's slot.
PACK_MIN_BYTES = 64 << 10
# alloc(shape, dtype) -> a writable numpy array: np.empty, or a shared-memory slot's allocator.
Alloc = Callable[..., np.ndarray]


def pad_rows(rows: Sequence[Any], pad_id: int, alloc: Alloc = np.empty) -> tuple[torch.Tensor, torch.Tensor]:
    counts = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    width = int(counts.max(initial=0))
    out = alloc((len(rows), width), np.int64)
    out.fill(pad_id)
    for r, row in enumerate(rows):
        out[r, : len(row)] = row
    return torch.from_numpy(out), torch.from_numpy(counts)


def paddable(values: Sequence[Any]) -> bool:
    return all(
        (isinstance(v, np.ndarray) and v.ndim == 1 and v.dtype.kind in "iub")
        or (isinstance(v, torch.Tensor) and v.ndim == 1 and not v.is_floating_point())
        for v in values
    )


def collate_samples(
    samples: list[dict[str, Any]],
    *,
    pad_field: str | None,
    pad_id: int = 0,
    lengths: np.ndarray | None = None,
    alloc: Alloc = np.empty,
) -> dict[str, Any]:
    """The default batch from decoded (and possibly transformed) sample dicts.

    ``lengths`` (from the index) is used when the length field is not a paddable array.
    """
    out: dict[str, Any] = {KEY: [s.get(KEY) for s in samples]}
    names = [k for k in samples[0] if k != KEY] if samples else []
    padded = False
    if pad_field is not None and samples and pad_field in samples[0]:
        col = [s[pad_field] for s in samples]
        if paddable(col):
            out[pad_field], out["lengths"] = pad_rows([np.asarray(v) for v in col], pad_id, alloc)
            padded = True
    if not padded:
        if lengths is not None:
            out["lengths"] = torch.as_tensor(np.asarray(lengths, dtype=np.int64))
    for name in names:
        if name == pad_field and padded:
            continue
        out[name] = stack_column([s[name] for s in samples], alloc)
    return out


_SCALARS = {int: np.int64, float: np.float64, bool: np.bool_}


def stack_column(values: list[Any], alloc: Alloc = np.empty) -> Any:
    """One field of a batch as torch's ``default_collate`` would give it, where that is a tensor:
    ints → ``LongTensor [B]``, floats → ``DoubleTensor [B]``, bools → ``BoolTensor [B]``; numeric
    arrays or tensors of one shape and dtype (decoded, resized images) → one tensor ``[B, ...]``.
    Anything else (bytes, strings, ragged arrays, mixed types, PIL images) stays the list, which is
    what ``default_collate`` cannot stack either. The stacked tensor is written into ``alloc``'s
    memory, so in a worker it is born in the shared slot and crosses to the trainer as one copy."""
    if not values:
        return values
    first = values[0]
    kind = type(first)
    scalar = _SCALARS.get(kind)
    if scalar is not None:
        if not all(type(v) is kind for v in values):
            return values
        out = alloc(len(values), scalar)
        try:
            out[:] = values
        except OverflowError:  # an int past int64: default_collate could not either
            return values
        return torch.from_numpy(out)
    if isinstance(first, np.generic) and first.dtype.kind in "biufc":  # numpy scalars: their dtype
        if not all(type(v) is kind for v in values):
            return values
        out = alloc(len(values), first.dtype)
        out[:] = values
        return torch.from_numpy(out)
    if kind is np.ndarray:
        return _stack_arrays(values, alloc) if first.dtype.kind in "biufc" else values
    if isinstance(first, torch.Tensor):
        return _stack_tensors(values, alloc)
    return values


def _stack_arrays(values: list[Any], alloc: Alloc) -> Any:
    shape, dtype = values[0].shape, values[0].dtype
    if not all(type(v) is np.ndarray and v.shape == shape and v.dtype == dtype for v in values):
        return values
    out = alloc((len(values), *shape), dtype)
    for k, v in enumerate(values):
        out[k] = v
    return torch.from_numpy(out)


def _stack_tensors(values: list[Any], alloc: Alloc) -> Any:
    t0 = values[0]
    if not all(
        isinstance(v, torch.Tensor) and v.shape == t0.shape and v.dtype == t0.dtype and v.device == t0.device
        for v in values
    ):
        return values
    if t0.device.type != "cpu" or t0.layout != torch.strided or any(v.requires_grad for v in values):
        return torch.stack(values)
    try:
        np_dtype = torch.empty(0, dtype=t0.dtype).numpy().dtype
    except (TypeError, RuntimeError):  # a dtype numpy lacks (bfloat16): stacked in torch's own memory
        return torch.stack(values)
    out = torch.from_numpy(alloc((len(values), *t0.shape), np_dtype))
    torch.stack(values, out=out)
    return out


class PackedBytes:
    """A list of byte strings as one uint8 tensor (in a worker's shared slot) + offsets."""

    __slots__ = ("data", "offsets")

    def __init__(self, data: torch.Tensor, offsets: np.ndarray):
        self.data = data
        self.offsets = offsets

    @classmethod
    def from_slices(
        cls, buffers: Sequence[Any], starts: Sequence[int], sizes: Sequence[int], alloc: Alloc = np.empty
    ) -> PackedBytes:
        """Copy buffer[k][starts[k] : starts[k]+sizes[k]] for every k into one tensor, once."""
        offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        dst = alloc(int(offsets[-1]), np.uint8)
        data = torch.from_numpy(dst)
        for k, (b, a, n) in enumerate(zip(buffers, starts, sizes)):
            dst[offsets[k] : offsets[k] + n] = b[a : a + n]
        return cls(data, offsets)

    def unpack(self) -> list[bytes]:
        arr = self.data.numpy()
        o = self.offsets.tolist()
        return [arr[a:b].tobytes() for a, b in zip(o[:-1], o[1:])]


def unpack_batch(batch: Any) -> Any:
    """Turn PackedBytes values of a default batch back into lists of bytes (in the trainer)."""
    if isinstance(batch, dict):
        for k, v in batch.items():
            if isinstance(v, PackedBytes):
                batch[k] = v.unpack()
        if isinstance(batch.get("lengths"), np.ndarray):
            batch["lengths"] = torch.from_numpy(batch["lengths"])
    return batch


def gather_field(groups, j: int, b: int, pack: bool, alloc: Alloc) -> Any:
    """Column ``j`` of a batch of ``b`` samples read through shard views (``groups``: (view, rows
    of the batch, index in shard) per shard): stacked, or with ``pack`` a large bytes field as
    one `PackedBytes` of slices of the views' maps."""
    if pack and groups[0][0].bytes_fields[j]:
        total = sum(int(v.sizes[li, j].sum()) for v, _, li in groups)
        if total >= PACK_MIN_BYTES:
            bufs: list[Any] = [None] * b
            starts = np.empty(b, dtype=np.int64)
            sizes = np.empty(b, dtype=np.int64)
            for v, rows, li in groups:
                starts[rows] = v.starts[li, j]
                sizes[rows] = v.sizes[li, j]
                for r in rows.tolist():
                    bufs[r] = v.u8
            return PackedBytes.from_slices(bufs, starts.tolist(), sizes.tolist(), alloc)
    values: list[Any] = [None] * b
    for v, rows, li in groups:
        for r, x in zip(rows.tolist(), v.values(j, li)):
            values[r] = x
    return stack_column(values, alloc)
