"""Image-text rows: where each image of a packed batch goes, and the images themselves.

An image-text dataset (`shardtool.pack.imagetext`) stores each sample's tokens as its image's
placeholders (one id, repeated by the image's token cost) then its text. Packed, the rows hold
those placeholders where the images go; this adds to a packed batch:

- ``images``: the images in batch order (row by row, left to right): the stored bytes, or what
  the loader's ``image_transform(bytes)`` returns, run in the worker that builds the batch.
- ``image_rows``, ``image_offsets``, ``image_tokens``: LongTensor [N], each image's row, the
  position in the row of its first placeholder, and its placeholders' count.
- ``image_mask``: BoolTensor [B, S], True at image positions. The labels are -100 where the target
  is an image position (the text after an image is trained from it; the image is not predicted).

Found from the placeholders, so it follows the plan's rows whatever they are; packing uses
``no-split`` for such datasets so an image is never cut across rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..format import FormatError
from .packlayout import BatchLayout

__all__ = ["IMAGE_KEYS", "ImageSpec", "of_dataset", "place_images"]

IMAGE_KEYS = ("images", "image_rows", "image_offsets", "image_tokens", "image_mask")


@dataclass(frozen=True)
class ImageSpec:
    field: str  # the images' field
    token_id: int  # their placeholders' id
    sizes: str | None = None  # interleaved documents: the field of their images' byte sizes

    def of_samples(self, reader: Any, ids: np.ndarray) -> list[list[Any]]:
        """Each sample's images, in its order (a pair's one; an interleaved document's, cut apart)."""
        names = (self.field,) if self.sizes is None else (self.field, self.sizes)
        values = reader.field_values(ids, names)
        if self.sizes is None:
            return [[v] for v in values[self.field]]
        out = []
        for data, sizes in zip(values[self.field], values[self.sizes]):
            ends = np.cumsum(sizes).tolist()
            out.append([data[a:z] for a, z in zip([0, *ends[:-1]], ends)])
        return out


def of_dataset(ds: Any, policy: str | None) -> ImageSpec | None:
    """The dataset's images as its manifest records them (None: no images); ValueError for a
    packing that would cut an image across rows."""
    info = ds.manifest.length.get("image")
    if not info:
        return None
    if policy is not None and policy != "no-split":
        raise ValueError(
            f"this dataset pairs images with text: packing={policy!r} would cut an image across rows; "
            "use packing='no-split' (documents longer than seq_len are left out and counted)"
        )
    return ImageSpec(str(info["field"]), int(info["token_id"]), info.get("sizes"))


def _runs(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first flat position, length) of every run of True within a row of ``mask`` [B, S]."""
    seq = mask.shape[1]
    flat = mask.reshape(-1)
    before = np.zeros_like(flat)
    before[1:] = flat[:-1]
    before[::seq] = False
    after = np.zeros_like(flat)
    after[:-1] = flat[1:]
    after[seq - 1 :: seq] = False
    starts = np.flatnonzero(flat & ~before)
    return starts, np.flatnonzero(flat & ~after) + 1 - starts


def place_images(
    out: dict[str, Any],
    lay: BatchLayout,
    spec: ImageSpec,
    images_of: Callable[[np.ndarray], list[list[Any]]],
    where: Callable[[int], str],
    *,
    name: str,
    transform: Callable[[bytes], Any] | None,
) -> dict[str, Any]:
    """``out``, a packed batch of ``lay`` (one document per span), with its images added.
    ``images_of(ids)``: those samples' images, each sample's in its order (`ImageSpec.of_samples`)."""
    ids = out[name].numpy()
    b, seq = ids.shape
    mask = ids == spec.token_id
    starts, counts = _runs(mask)
    span = np.searchsorted(lay.flat_start, starts, side="right") - 1
    # The k-th run of placeholders in a piece is its document's k-th image (a piece is a whole
    # document: no-split).
    spans, first, per = np.unique(span, return_index=True, return_counts=True)
    docs = lay.docs[lay.doc_index()[spans]] if len(spans) else np.zeros(0, np.int64)
    images = []
    for gid, n, found in zip(docs.tolist(), per.tolist(), images_of(docs) if len(docs) else []):
        if len(found) != n:
            raise FormatError(f"{where(gid)}: {n} runs of image placeholders, but {len(found)} images stored")
        images += found
    if transform is not None:
        images = [transform(bytes(x)) for x in images]
    if "labels" in out:  # a full batch: an image position is never a target
        labels = out["labels"].numpy().reshape(-1)
        labels[:-1][mask.reshape(-1)[1:]] = -100
    out["images"] = images
    out["image_rows"] = torch.from_numpy(starts // seq)
    out["image_offsets"] = torch.from_numpy(starts % seq)
    out["image_tokens"] = torch.from_numpy(counts)
    out["image_mask"] = torch.from_numpy(mask)
    return out
