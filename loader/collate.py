"""The default batch, and how large payloads cross from a worker to the trainer.

Default batch: ``__key__`` (list of keys); the length field, when it is a 1-D integer array,
as a padded ``LongTensor [B, L]`` (padded with ``pad_id``) plus ``lengths [B]`` (elements per
row); otherwise only ``lengths`` (from the index); every other field as a list of decoded values.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

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


def collate_samples(samples: list[dict[str, Any]], *, pad_field: str | None, pad_id: int = 0,
                    lengths: np.ndarray | None = None, alloc: Alloc = np.empty) -> dict[str, Any]:
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
        out[name] = [s[name] for s in samples]
    return out


class PackedBytes:
    """A list of byte strings as one uint8 tensor (in a worker's shared slot) + offsets."""

    __slots__ = ("data", "offsets")

    def __init__(self, data: torch.Tensor, offsets: np.ndarray):
        self.data = data
        self.offsets = offsets

    @classmethod
    def from_slices(cls, buffers: Sequence[Any], starts: Sequence[int], sizes: Sequence[int],
                    alloc: Alloc = np.empty) -> "PackedBytes":
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
