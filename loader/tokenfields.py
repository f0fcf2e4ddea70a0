"""Per-token fields through packing: arrays aligned with the tokens (``loss_mask``, ``labels``,
role or segment ids) cut, placed and padded exactly as the tokens are.

A field is *per-token* when it is a 1-D array with as many elements as the length field in every
sample. Packing places each one in a [B, S] array beside ``input_ids``: a piece's values where its
tokens are, 0 on padding. The ``eos_id`` that packing appends after a document is a token the data
does not store: it takes the value of the document's last token, so a document that ends on a
trained span trains its end too.

Two names mean something to the labels a packed batch carries (next-token targets, -100 where no
loss is taken):

- ``loss_mask``: labels are -100 where the mask of the *predicted* token is 0 (the target
  ``input_ids[i + 1]`` of position i is trained only where ``loss_mask[i + 1]`` is set), as
  well as across documents and on padding. The mask itself is delivered too.
- ``labels``: stored targets aligned with the tokens (Hugging Face's convention: unshifted, -100
  where no loss is taken) are the targets instead of the tokens themselves: the batch's
  ``labels[i]`` is the stored ``labels[i + 1]`` of the same piece. The appended eos's target is
  ``eos_id`` where the document's last stored label is trained, else -100. A lean batch carries
  the stored field as it is (unshifted); `shardtool.loader.packed.lean_to_full` shifts it.

Which fields are carried is decided once, from the manifest, when the loader is built
(`choose`): a field that is not an array, or whose first sample is not aligned, is refused there,
by name, with the way to leave it out; none is dropped without saying so. Every batch checks its
samples again and names the sample and field that disagree.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..format import FieldSpec, FormatError
from .collate import KEY, Alloc
from .packlayout import BatchLayout

__all__ = ["LABELS", "LOSS_MASK", "RESERVED", "choose", "out_dtype", "place"]

LOSS_MASK = "loss_mask"
LABELS = "labels"
# Keys a packed batch already has: a per-token field cannot take one (``labels`` is read instead).
RESERVED = ("input_ids", "position_ids", "cu_seqlens", "max_seqlen", "lengths", "doc_offsets", "valid", KEY)


def _is_array(spec: FieldSpec) -> bool:
    """An array by the manifest: an Arrow/JSONL array column, or a tar member saved as npy."""
    return spec.storage == "array" or spec.encoding == "npy"


def choose(
    fields: Sequence[FieldSpec],
    length_field: str | None,
    wanted: Sequence[str] | None,
    first: Callable[[], dict[str, Any]] | None = None,
    carried: Sequence[str] = (),
) -> tuple[str, ...]:
    """The per-token fields a packed batch carries, in the manifest's order. ``wanted`` None: every
    array field but the length field (the others, text or metadata, are named in a warning: they
    have no place in a row of tokens); a list: exactly those, each checked. ``first()``: the
    dataset's first sample, read only when an array field is to be carried, to refuse one that is
    not aligned before training starts. ``carried``: fields the batch carries otherwise (an
    image-text dataset's images), not warned about. ValueError naming the field."""
    by_name = {f.name: f for f in fields}
    arrays = [f.name for f in fields if f.name != length_field and f.name not in carried and _is_array(f)]
    if wanted is None:
        chosen = arrays
        others = [f.name for f in fields if f.name not in (length_field, *carried) and f.name not in arrays]
        if others:
            warnings.warn(
                f"packed batches carry the tokens and the per-token array fields only; "
                f"{', '.join(repr(o) for o in others)} {'is' if len(others) == 1 else 'are'} not "
                f"per-token and left out (token_fields=[...] names the fields to carry and silences this)",
                stacklevel=_outside_stacklevel(),
            )
    else:
        if isinstance(wanted, str):
            raise ValueError(f"token_fields must be a list of field names, found the string {wanted!r}")
        chosen = []
        for name in wanted:
            spec = by_name.get(name)
            if spec is None:
                raise ValueError(f"token_fields: {name!r} is not a field of the dataset (fields: {', '.join(by_name)})")
            if name == length_field:
                raise ValueError(f"token_fields: {name!r} is the length field: it is the tokens themselves")
            if name in carried:
                raise ValueError(f"token_fields: {name!r} holds the samples' images: batches carry them as images")
            if not _is_array(spec):
                raise ValueError(
                    f"token_fields: field {name!r} holds {spec.storage} values, not an array aligned with "
                    f"the tokens: it cannot be packed"
                )
            if name not in chosen:
                chosen.append(name)
        chosen = [n for n in arrays if n in chosen]
    for name in chosen:
        if name in RESERVED:
            raise ValueError(
                f"field {name!r} has the name of a key packing builds; rename it at pack time "
                "(or leave it out with token_fields=[...])"
            )
    if chosen and first is not None and length_field is not None:
        sample = first()
        n = len(sample[length_field])
        for name in chosen:
            value = sample[name]
            size = len(value) if isinstance(value, np.ndarray) and value.ndim == 1 else None
            if size != n:
                what = f"{size} values" if size is not None else f"a {type(value).__name__}"
                raise ValueError(
                    f"field {name!r} is not aligned with the tokens: sample {sample.get(KEY)!r} has {what} "
                    f"where {length_field!r} has {n} tokens; leave it out with token_fields="
                    f"{[c for c in chosen if c != name]!r}"
                )
    return tuple(chosen)


def _outside_stacklevel() -> int:
    """The ``stacklevel`` of the first caller outside this package: the user's line that built the
    loader, however deep in the package the warning is raised."""
    here = inspect.currentframe()
    frame, level = (here.f_back if here is not None else None), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("shardtool."):
        frame, level = frame.f_back, level + 1
    return level


def out_dtype(stored: np.dtype) -> np.dtype:
    """The dtype a field is delivered in: the stored one where torch has it, unsigned ones widened."""
    stored = np.dtype(stored)
    if stored.kind == "u" and stored.itemsize > 1:
        return np.dtype(np.int32) if stored.itemsize == 2 else np.dtype(np.int64)
    return stored


def place(
    values: Sequence[np.ndarray],
    counts: np.ndarray,
    lay: BatchLayout,
    n: np.ndarray,
    *,
    name: str,
    where: Callable[[int], str],
    alloc: Alloc,
) -> np.ndarray:
    """Field ``name`` of the batch ``lay`` laid out like its tokens: ``values[d]`` is the array of
    ``lay.docs[d]``, ``counts[d]`` its stored token count (each checked against it), ``n`` the
    elements each span copies (`BatchLayout.copy_counts`, which also found the appended eos
    tokens). 0 elsewhere (padding); ``labels``' padding is -100."""
    sizes = np.fromiter((len(v) for v in values), dtype=np.int64, count=len(values))
    bad = np.flatnonzero(sizes != counts)
    if bad.size:
        d = int(bad[0])
        raise FormatError(
            f"{where(int(lay.docs[d]))}: field {name!r} has {int(sizes[d])} values where the tokens are "
            f"{int(counts[d])}: a per-token field must be aligned with the tokens"
        )
    stored = np.result_type(*[np.asarray(v).dtype for v in values]) if len(values) else np.dtype(np.int64)
    out = alloc((lay.b, lay.seq), out_dtype(stored))
    out.fill(-100 if name == LABELS else 0)
    flat = out.reshape(-1)
    lay.copy_pieces(flat, values, n)
    if lay.eos_at is not None and lay.eos_at.size:
        if lay.eos_doc is None:
            raise RuntimeError("shardtool internal error: `BatchLayout.copy_counts` sets it with eos_at")
        docs = lay.eos_doc.tolist()
        flat[lay.eos_at] = np.array([values[d][-1] if len(values[d]) else 0 for d in docs], dtype=out.dtype)
        if name == LABELS and lay.packing.eos_id is not None:
            # The eos is the target after the document's last token, where that one is trained.
            at = lay.eos_at[flat[lay.eos_at] != -100]
            flat[at] = lay.packing.eos_id
    return out


def of_dataset(ds: Any, wanted: Sequence[str] | None) -> tuple[str, ...]:
    """`choose` for an open `shardtool.format.Dataset`: its manifest's fields, its first sample."""
    m = ds.manifest

    def first() -> dict[str, Any]:
        shard = next(i for i, s in enumerate(m.shards) if s.samples)
        return ds.read(shard, 0)

    has_samples = any(s.samples for s in m.shards)
    images = m.length.get("image") or {}
    carried = tuple(images[k] for k in ("field", "sizes") if images.get(k))
    return choose(m.fields, m.length.get("field"), wanted, first if has_samples else None, carried)
