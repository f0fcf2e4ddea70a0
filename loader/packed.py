"""Packed batches: the plan's rows of spans (`shardtool.plan.packing.Rows`) as tensors for varlen attention.

For a batch of B rows of S = ``seq_len`` tokens:

- ``input_ids`` (the key is ``name``): LongTensor [B, S]; each row its pieces back to back (the
  ``eos_id`` after a document's last token when packing adds it), then ``pad_id``.
- ``labels``: LongTensor [B, S], the next token where it belongs to the same piece, else -100 (a
  piece's last token, padding).
- ``position_ids``: LongTensor [B, S], 0 at the start of every piece, +1 per token. A continuation
  piece of a split document restarts at 0 too: it attends to nothing before it, so under RoPE
  (relative) an offset would change nothing, while learned absolute positions stay below S, and
  code that finds boundaries from position resets (HF's padding-free attention) sees the pieces
  we mean. A row's padding continues its last piece's positions.
- ``cu_seqlens``: IntTensor [B * max_docs_per_row + 1], the piece boundaries over the flattened
  batch (``flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=True)``
  on [B * S, heads, dim]). A row's padding is part of its last piece: causal attention never
  lets a real token see the padding after it, and no padding query is left with nothing to
  attend to. Unused entries repeat B * S (empty sequences), so the shape is static.
- ``max_seqlen``: int, the longest piece (padding included).
- ``lengths``: LongTensor [B], real tokens per row (eos included).
- ``doc_offsets``: LongTensor [B * max_docs_per_row], the offset in its document of the first
  token of each piece of ``cu_seqlens`` (piece i is ``cu_seqlens[i] : cu_seqlens[i + 1]``): 0 for
  a document's start, > 0 for a continuation of a split document; -1 for a row of padding and the
  unused entries. Within a pass a split document's pieces come head first: by step, then DP
  rank, then row (`shardtool.plan.group.in_serving_order`).
- ``__key__``: per row, the list of its pieces' document keys.

``input_ids``, ``labels`` and ``position_ids`` are views of one [3, B, S] allocation (one slot
allocation in a worker, fewer fresh pages in the trainer).

``outputs="lean"`` builds only what a trainer cannot derive on its device: ``input_ids`` in the
stored dtype's int32 where it fits (`lean_dtype`; else int64), ``cu_seqlens``, ``max_seqlen``,
``lengths`` and ``doc_offsets``, no keys. `lean_to_full` derives ``labels`` (int64, as cross_entropy needs) and
``position_ids`` from them on any device, equal to the full batch's. A quarter of the bytes per
batch (one int32 [B, S] for three int64) to build, to copy out of a worker's slot and to move to the GPU.

`block_causal_mask` turns a batch into the boolean mask for ``scaled_dot_product_attention``;
`cost_terms` gives its tokens and squared piece lengths as a cost model prices them.
`packed_batch` takes the tokens from any callable; `PackedReader` copies them straight from a
`BatchReader`'s mapped shards (one memcpy per piece, or per run of pieces lying side by side in the
shard), falling back to decoding samples; its `read_planned` lays a pass's lean batches out a chunk
of batches at a time (`packchunk`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..format import FormatError
from ..plan.arrays import gather_runs
from ..plan.packing import Packing, Rows
from .collate import KEY, Alloc
from .imagerows import ImageSpec, place_images
from .ondevice import IGNORE_INDEX, block_causal_mask, cost_terms, lean_to_full
from .packchunk import CHUNK, LeanChunk
from .packlayout import BatchLayout, copy_runs, counting, joined_runs, lean_dtype
from .reader import BatchReader
from .scratch import Scratch
from .tokenfields import LABELS, LOSS_MASK, place
from .tokenpieces import TokenSources

__all__ = [
    "IGNORE_INDEX",
    "OUTPUTS",
    "PackedReader",
    "block_causal_mask",
    "cost_terms",
    "lean_dtype",
    "lean_to_full",
    "packed_batch",
]

OUTPUTS = ("full", "lean")


def _check_outputs(outputs: str) -> str:
    if outputs not in OUTPUTS:
        raise ValueError(f"outputs must be one of {OUTPUTS}, found {outputs!r}")
    return outputs


def _finish(
    ids: np.ndarray,
    rest: np.ndarray | None,
    lay: BatchLayout,
    keys: Sequence[Any] | None,
    *,
    name: str,
    pad_id: int,
    alloc: Alloc,
    fields: dict[str, np.ndarray] | None = None,
) -> dict[str, Any]:
    """Everything but the token copy: eos, padding, cu_seqlens, and for a full batch labels and
    positions. ``ids``: [B, S] with the tokens; ``rest``: the [2, B, S] int64 for labels and
    positions (a full batch: one allocation with ``ids``, fresh pages cost more than the
    arithmetic here), None for a lean one; ``keys`` None: no ``__key__``; ``fields``: the
    per-token fields placed (`tokenfields.place`), whose ``labels`` and ``loss_mask`` decide the
    targets of a full batch."""
    b, seq, packing = lay.b, lay.seq, lay.packing
    maxd = packing.max_docs_per_row
    if maxd is None:
        raise RuntimeError("shardtool internal error: Packing.__post_init__ resolves None to its default")
    flat = ids.reshape(-1)
    if lay.eos_at is not None:
        flat[lay.eos_at] = packing.eos_id
    # Padding is each row's tail, usually a few tokens (best-fit fills rows to ~0.999).
    row_start = np.arange(b, dtype=np.int64) * seq
    pad = gather_runs(counting(b * seq), row_start + lay.row_tokens, seq - lay.row_tokens)
    flat[pad] = pad_id
    # Pieces start the segments; a row without pieces is one segment of padding.
    empty = row_start[lay.row_tokens == 0]
    starts = np.union1d(lay.flat_start, empty) if empty.size else lay.flat_start
    seg_len = np.diff(np.append(starts, b * seq))
    cu = alloc(b * maxd + 1, np.int32)
    cu[: len(starts)] = starts
    cu[len(starts) :] = b * seq
    lengths = alloc(b, np.int64)
    lengths[:] = lay.row_tokens
    doc_offsets = alloc(b * maxd, np.int64)
    doc_offsets[:] = -1
    doc_offsets[np.searchsorted(starts, lay.flat_start) if empty.size else slice(0, len(starts))] = lay.rows.span_start
    out: dict[str, Any] = {} if keys is None else {KEY: lay.keys_per_row(keys)}
    out[name] = torch.from_numpy(ids)
    fields = fields or {}
    if rest is not None:
        labels, positions = rest
        lab, pos = labels.reshape(-1), positions.reshape(-1)
        target = fields.pop(LABELS).reshape(-1) if LABELS in fields else flat
        lab[:-1] = target[1:]
        if LOSS_MASK in fields:
            lab[:-1][fields[LOSS_MASK].reshape(-1)[1:] == 0] = IGNORE_INDEX
        lab[-1:] = IGNORE_INDEX
        lab[lay.flat_start + lay.rows.span_len - 1] = IGNORE_INDEX
        lab[pad] = IGNORE_INDEX
        np.subtract(counting(b * seq), np.repeat(starts, seg_len), out=pos)
        out["labels"] = torch.from_numpy(labels)
        out["position_ids"] = torch.from_numpy(positions)
    out["cu_seqlens"] = torch.from_numpy(cu)
    out["max_seqlen"] = int(seg_len.max(initial=0))
    out["lengths"] = torch.from_numpy(lengths)
    out["doc_offsets"] = torch.from_numpy(doc_offsets)
    for field, values in fields.items():
        out[field] = torch.from_numpy(values)
    return out


def _placed(
    lay: BatchLayout,
    names: Sequence[str],
    values_of: Callable[[], Mapping[str, Sequence[Any]]],
    counts: np.ndarray,
    n: np.ndarray,
    where: Callable[[int], str],
    alloc: Alloc,
) -> dict[str, np.ndarray] | None:
    """The per-token fields ``names`` of the batch ``lay``, each laid out like its tokens."""
    if not names:
        return None
    values = values_of()
    return {f: place(values[f], counts, lay, n, name=f, where=where, alloc=alloc) for f in names}


def _block(lay: BatchLayout, alloc: Alloc, into: np.ndarray | None) -> np.ndarray:
    if into is None:
        return alloc((3, lay.b, lay.seq), np.int64)
    if into.shape != (3, lay.b, lay.seq) or into.dtype != np.int64:
        raise ValueError(f"into must be int64 of shape {(3, lay.b, lay.seq)}, found {into.dtype} {into.shape}")
    return into


def packed_batch(
    rows: Rows,
    tokens_of: Callable[[np.ndarray], Sequence[Any]],
    packing: Packing,
    *,
    keys_of: Callable[[np.ndarray], Sequence[Any]] | None = None,
    name: str = "input_ids",
    pad_id: int = 0,
    rows_per_batch: int | None = None,
    alloc: Alloc = np.empty,
    into: np.ndarray | None = None,
    outputs: str = "full",
    token_fields: Sequence[str] = (),
    fields_of: Callable[[np.ndarray], Mapping[str, Sequence[Any]]] | None = None,
    where: Callable[[int], str] = lambda g: f"sample {g}",
) -> dict[str, Any]:
    """The packed batch of ``rows`` (span_pos = sample ids). ``tokens_of(ids)`` gives the 1-D
    integer token arrays of the sorted distinct ``ids``, ``keys_of(ids)`` their keys (default:
    the ids); ``fields_of(ids)`` their per-token fields ``token_fields`` by name (see
    `shardtool.loader.tokenfields`), ``where(id)`` names a sample in an error. ``rows_per_batch`` pads a short batch with rows of padding to a fixed shape.
    ``into``: an int64 [3, B, S] block (rows of a larger batch) to write tokens, labels and
    positions into, instead of a new one (full batches only). ``outputs``: "full" or "lean"."""
    lean = _check_outputs(outputs) == "lean"
    if lean and into is not None:
        raise ValueError("into= is a full batch's [3, B, S] block; a lean batch has none")
    lay = BatchLayout(rows, packing, rows_per_batch)
    arrays = list(tokens_of(lay.docs))
    if len(arrays) != len(lay.docs):
        raise ValueError(f"tokens_of returned {len(arrays)} arrays for {len(lay.docs)} samples")
    counts = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
    n = lay.copy_counts(counts, where)
    if lean:
        stored = np.result_type(*[np.asarray(a).dtype for a in arrays]) if arrays else np.dtype(np.int32)
        ids, rest = alloc((lay.b, lay.seq), lean_dtype(stored, pad_id, packing.eos_id)), None
    else:
        block = _block(lay, alloc, into)
        ids, rest = block[0], block[1:]
    lay.copy_pieces(ids.reshape(-1), arrays, n)
    keys = None if lean else list(keys_of(lay.docs)) if keys_of is not None else lay.docs.tolist()
    fields = None  # `_placed` of no fields
    if token_fields:
        if fields_of is None:
            raise ValueError("token_fields needs fields_of, which gives their values")
        fields = _placed(lay, token_fields, lambda: fields_of(lay.docs), counts, n, where, alloc)
    return _finish(ids, rest, lay, keys, name=name, pad_id=pad_id, alloc=alloc, fields=fields)


class PackedReader:
    """Packed batches read from a `BatchReader`: tokens copied straight from its mapped shards.
    ``outputs``: "full" (the default) or "lean" (see the module's docstring)."""

    def __init__(
        self,
        reader: BatchReader,
        packing: Packing,
        *,
        name: str = "input_ids",
        pad_id: int = 0,
        rows_per_batch: int | None = None,
        outputs: str = "full",
        token_fields: Sequence[str] = (),
        images: ImageSpec | None = None,
        image_transform: Callable[[bytes], Any] | None = None,
    ):
        self.reader, self.packing = reader, packing
        # An image-text dataset's images and where they go (loader/imagerows.py).
        self.images, self.image_transform = images, image_transform
        self.token_fields = tuple(token_fields)  # per-token fields carried (loader/tokenfields.py)
        self.name, self.pad_id, self.rows_per_batch = name, int(pad_id), rows_per_batch
        self.outputs = _check_outputs(outputs)
        self.scratch = Scratch()
        self._chunk: tuple | None = None  # (the pass's rows, its LeanChunk being read)

    def read(
        self,
        rows: Rows,
        alloc: Alloc | None = None,
        *,
        rows_per_batch: int | None = None,
        into: np.ndarray | None = None,
    ) -> dict[str, Any]:
        """The packed batch of ``rows`` (span_pos = global sample ids), of ``rows_per_batch`` rows
        (default: the reader's); ``into``: see `packed_batch`."""
        alloc = alloc or np.empty
        if into is not None and self.outputs == "lean":
            raise ValueError("into= is a full batch's [3, B, S] block; a lean batch has none")
        packing = self.packing if rows.seq_len == self.packing.seq_len else self.packing.cut_to(rows.seq_len)
        lay = BatchLayout(rows, packing, rows_per_batch or self.rows_per_batch, per_span=True)
        # Per span: the pieces are what is counted as read, and all a remote tar dataset fetches.
        spans = (lay.rows.span_start, lay.rows.span_len)
        src = self.reader.token_sources(lay.docs, keys=self.outputs == "full", spans=spans)
        if src is None:
            out = self._decoded(rows, lay, alloc, into)
        else:
            out = self.copy_from(lay, src, alloc, into, self.reader.where)
        if self.images is None:
            return out
        spec = self.images
        return place_images(
            out,
            lay,
            spec,
            lambda ids: spec.of_samples(self.reader, ids),
            self.reader.where,
            name=self.name,
            transform=self.image_transform,
        )

    def read_planned(self, rows: Rows, row_offsets: np.ndarray, b: int, alloc: Alloc | None = None) -> dict[str, Any]:
        """Batch ``b`` of a pass whose rows are ``rows`` (batch b's: ``row_offsets[b] :
        row_offsets[b + 1]``), equal to ``read`` of its rows: lean batches are laid out a chunk
        of batches at a time (`packchunk`), for a fraction of the per-batch numpy calls."""
        alloc = alloc or np.empty
        if self.outputs != "lean" or self.token_fields or self.images is not None:
            return self.read(rows.slice(int(row_offsets[b]), int(row_offsets[b + 1])), alloc)
        first = b - b % CHUNK
        chunk = self._chunk
        if chunk is None or chunk[0] is not rows or chunk[1].first != first:
            count = min(CHUNK, len(row_offsets) - 1 - first)
            chunk = self._chunk = (rows, LeanChunk(self, rows, row_offsets, first, count))
        lay = chunk[1]
        if not lay.ok or b in lay.bad:
            return self.read(rows.slice(int(row_offsets[b]), int(row_offsets[b + 1])), alloc)
        return lay.read(self, b - first, alloc)

    def copy_from(
        self, lay: BatchLayout, src: TokenSources, alloc: Alloc, into: np.ndarray | None, where: Callable[[int], str]
    ) -> dict[str, Any]:
        """The batch of ``lay`` from ``src`` (`BatchReader.token_sources` of ``lay.docs``; `read_together`
        passes several readers' sources joined), ``where`` naming a document in errors."""
        keys, bufs, which, first, counts, dtype = src
        n = lay.copy_counts(counts, where)
        item = dtype.itemsize
        if self.outputs == "lean":
            ids, rest = alloc((lay.b, lay.seq), lean_dtype(dtype, self.pad_id, self.packing.eos_id)), None
        else:
            block = _block(lay, alloc, into)
            ids, rest = block[0], block[1:]
        narrow = ids if ids.dtype == dtype else self.scratch.array((lay.b, lay.seq), dtype)
        runs = joined_runs(
            lay.flat_start * item, lay.of_span(which), (lay.of_span(first) + lay.rows.span_start) * item, n * item
        )
        copy_runs(ids, narrow, bufs, *(r.tolist() for r in runs))
        fields = _placed(
            lay,
            self.token_fields,
            lambda: self.reader.field_values(lay.docs, self.token_fields),
            counts,
            n,
            where,
            alloc,
        )
        return _finish(
            ids,
            rest,
            lay,
            keys if rest is not None else None,
            name=self.name,
            pad_id=self.pad_id,
            alloc=alloc,
            fields=fields,
        )

    def _decoded(self, rows: Rows, lay: BatchLayout, alloc: Alloc, into: np.ndarray | None) -> dict[str, Any]:
        """Remote shards, or payloads that are not plain arrays: decode sample by sample."""
        field = self.reader.pad_field
        samples = self.reader.read_samples(np.unique(lay.docs))  # packed_batch's tokens_of: sorted, distinct
        if samples and not (field and isinstance(samples[0].get(field), np.ndarray)):
            raise FormatError(
                f"packing needs the length field to be a 1-D integer token array; "
                f"this dataset's length field is {field!r}"
            )
        return packed_batch(
            rows,
            # field is None only where there are no samples (else refused above): no tokens to give
            lambda _: [s[field] for s in samples] if field is not None else [],
            self.packing,
            keys_of=lambda _: [s[KEY] for s in samples],
            name=self.name,
            pad_id=self.pad_id,
            rows_per_batch=lay.b,
            alloc=alloc,
            into=into,
            outputs=self.outputs,
            token_fields=self.token_fields,
            fields_of=lambda _: {f: [s[f] for s in samples] for f in self.token_fields},
            where=self.reader.where,
        )

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_chunk": None}  # a worker makes its own (and its scratch)
