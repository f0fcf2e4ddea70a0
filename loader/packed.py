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
- ``__key__``: per row, the list of its pieces' document keys.

``input_ids``, ``labels`` and ``position_ids`` are views of one [3, B, S] allocation (one slot
allocation in a worker, fewer fresh pages in the trainer).

`block_causal_mask` turns a batch into the boolean mask for ``scaled_dot_product_attention``.
`packed_batch` takes the tokens from any callable; `PackedReader` copies them straight from a
`BatchReader`'s mapped shards (one memcpy per piece), falling back to decoding samples.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..format import FormatError
from ..plan.arrays import gather_runs
from ..plan.packing import Packing, Rows
from .collate import KEY, Alloc
from .reader import BatchReader

__all__ = ["IGNORE_INDEX", "PackedReader", "block_causal_mask", "packed_batch", "read_together"]

IGNORE_INDEX = -100  # what torch.nn.functional.cross_entropy ignores by default


class _Layout:
    """Where every span of the batch goes in the flattened [B * S] batch."""

    def __init__(self, rows: Rows, packing: Packing, rows_per_batch: int | None):
        if rows.seq_len != packing.seq_len:
            raise ValueError(f"rows were packed for seq_len {rows.seq_len}, the batch is for {packing.seq_len}")
        b = rows.num_rows if rows_per_batch is None else int(rows_per_batch)
        if b < rows.num_rows:
            raise ValueError(f"{rows.num_rows} rows do not fit a batch of {b} rows")
        per_row = np.diff(rows.row_offsets)
        if rows.span_len.size and int(rows.span_len.min()) < 1:
            raise ValueError("a span of no tokens: every span must hold at least one token")
        if per_row.size and int(per_row.max()) > packing.max_docs_per_row:
            raise ValueError(
                f"a row has {int(per_row.max())} pieces, more than max_docs_per_row {packing.max_docs_per_row}"
            )
        seq = packing.seq_len
        if b * seq >= 2**31:
            raise ValueError(f"{b} rows of {seq} tokens overflow int32 cu_seqlens")
        self.b, self.seq, self.packing, self.rows = b, seq, packing, rows
        row_of = np.repeat(np.arange(rows.num_rows, dtype=np.int64), per_row)
        before = np.cumsum(rows.span_len) - rows.span_len  # tokens of the batch before each span
        self.flat_start = row_of * seq + before - before[rows.row_offsets[row_of]] if row_of.size else before
        self.row_tokens = np.zeros(b, np.int64)
        self.row_tokens[: rows.num_rows] = rows.row_tokens()
        if (self.row_tokens > seq).any():
            raise ValueError(f"a row holds {int(self.row_tokens.max())} tokens, more than seq_len {seq}")
        self.docs, self.doc_of_span = np.unique(rows.span_pos, return_inverse=True)
        self.doc_of_span = self.doc_of_span.reshape(-1)
        self.eos_at: np.ndarray | None = None  # flat positions of eos tokens, set by copy_counts

    def copy_counts(self, counts: np.ndarray, where: Callable[[int], str]) -> np.ndarray:
        """Tokens to copy per span (the eos is written, not copied), checked against each
        document's stored token count ``counts`` (per distinct document)."""
        rows, extra = self.rows, self.packing.extra_tokens
        n = counts[self.doc_of_span]
        end = rows.span_start + rows.span_len
        bad = np.flatnonzero(end > n + extra)
        if bad.size:
            k = int(bad[0])
            raise FormatError(
                f"{where(int(self.docs[self.doc_of_span[k]]))} has {int(n[k])} tokens, but the plan "
                f"packs its tokens up to {int(end[k])}{' (eos included)' if extra else ''}: "
                "lengths and data disagree"
            )
        self.eos_at = self.flat_start[end == n + 1] + rows.span_len[end == n + 1] - 1 if extra else None
        return np.minimum(rows.span_len, np.maximum(n - rows.span_start, 0))

    def keys_per_row(self, keys: Sequence[Any]) -> list[list[Any]]:
        per_span = [keys[d] for d in self.doc_of_span.tolist()]
        bounds = self.rows.row_offsets.tolist()
        return [per_span[a:z] for a, z in zip(bounds[:-1], bounds[1:])] + [
            [] for _ in range(self.b - self.rows.num_rows)
        ]


@functools.lru_cache(maxsize=4)
def _counting(n: int) -> np.ndarray:
    """0 .. n-1, read-only, kept: a fresh [B * S] arange per batch costs as much as the positions."""
    out = np.arange(n, dtype=np.int64)
    out.flags.writeable = False
    return out


def _finish(
    block: np.ndarray, lay: _Layout, keys: Sequence[Any], *, name: str, pad_id: int, alloc: Alloc
) -> dict[str, Any]:
    """Everything but the token copy: eos, padding, labels, positions, cu_seqlens. ``block`` is
    [3, B, S] int64 with the tokens in ``block[0]``; labels and positions go to the others (one
    allocation: fresh pages cost more than the arithmetic here)."""
    b, seq, packing = lay.b, lay.seq, lay.packing
    ids, labels, positions = block
    flat, lab, pos = ids.reshape(-1), labels.reshape(-1), positions.reshape(-1)
    if lay.eos_at is not None:
        flat[lay.eos_at] = packing.eos_id
    lab[:-1] = flat[1:]
    lab[-1:] = IGNORE_INDEX
    lab[lay.flat_start + lay.rows.span_len - 1] = IGNORE_INDEX
    # Padding is each row's tail, usually a few tokens (best-fit fills rows to ~0.999).
    row_start = np.arange(b, dtype=np.int64) * seq
    pad = gather_runs(_counting(b * seq), row_start + lay.row_tokens, seq - lay.row_tokens)
    flat[pad] = pad_id
    lab[pad] = IGNORE_INDEX
    # Pieces start the segments; a row without pieces is one segment of padding.
    empty = row_start[lay.row_tokens == 0]
    starts = np.union1d(lay.flat_start, empty) if empty.size else lay.flat_start
    seg_len = np.diff(np.append(starts, b * seq))
    cu = alloc(b * packing.max_docs_per_row + 1, np.int32)
    cu[: len(starts)] = starts
    cu[len(starts) :] = b * seq
    np.subtract(_counting(b * seq), np.repeat(starts, seg_len), out=pos)
    lengths = alloc(b, np.int64)
    lengths[:] = lay.row_tokens
    return {
        KEY: lay.keys_per_row(keys),
        name: torch.from_numpy(ids),
        "labels": torch.from_numpy(labels),
        "position_ids": torch.from_numpy(positions),
        "cu_seqlens": torch.from_numpy(cu),
        "max_seqlen": int(seg_len.max(initial=0)),
        "lengths": torch.from_numpy(lengths),
    }


def _block(lay: _Layout, alloc: Alloc, into: np.ndarray | None) -> np.ndarray:
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
) -> dict[str, Any]:
    """The packed batch of ``rows`` (span_pos = sample ids). ``tokens_of(ids)`` gives the 1-D
    integer token arrays of the sorted distinct ``ids``, ``keys_of(ids)`` their keys (default:
    the ids). ``rows_per_batch`` pads a short batch with rows of padding to a fixed shape.
    ``into``: an int64 [3, B, S] block (rows of a larger batch) to write tokens, labels and
    positions into, instead of a new one."""
    lay = _Layout(rows, packing, rows_per_batch)
    arrays = list(tokens_of(lay.docs))
    if len(arrays) != len(lay.docs):
        raise ValueError(f"tokens_of returned {len(arrays)} arrays for {len(lay.docs)} samples")
    counts = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
    n = lay.copy_counts(counts, lambda g: f"sample {g}")
    block = _block(lay, alloc, into)
    flat = block[0].reshape(-1)
    for dst, d, a, k in zip(lay.flat_start.tolist(), lay.doc_of_span.tolist(), rows.span_start.tolist(), n.tolist()):
        flat[dst : dst + k] = arrays[d][a : a + k]
    keys = list(keys_of(lay.docs)) if keys_of is not None else lay.docs.tolist()
    return _finish(block, lay, keys, name=name, pad_id=pad_id, alloc=alloc)


class PackedReader:
    """Packed batches read from a `BatchReader`: tokens copied straight from its mapped shards."""

    def __init__(
        self,
        reader: BatchReader,
        packing: Packing,
        *,
        name: str = "input_ids",
        pad_id: int = 0,
        rows_per_batch: int | None = None,
    ):
        self.reader, self.packing = reader, packing
        self.name, self.pad_id, self.rows_per_batch = name, int(pad_id), rows_per_batch
        self._scratch_buf: np.ndarray | None = None

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
        lay = _Layout(rows, self.packing, rows_per_batch or self.rows_per_batch)
        src = self.reader.token_sources(lay.docs)
        if src is None:
            return self._decoded(rows, lay, alloc, into)
        return self._copied(lay, src, alloc, into, self.reader.where)

    def _copied(
        self, lay: _Layout, src: tuple, alloc: Alloc, into: np.ndarray | None, where: Callable[[int], str]
    ) -> dict[str, Any]:
        """The batch of ``lay`` from ``src`` (`BatchReader.token_sources` of ``lay.docs``)."""
        keys, bufs, which, first, counts, dtype = src
        n = lay.copy_counts(counts, where)
        item = dtype.itemsize
        # Raw-byte copies in the stored dtype (a memoryview slice assignment is a bare memcpy,
        # as in BatchReader), then one vectorised widening: cheaper than a cast per piece.
        narrow = self._scratch((lay.b, lay.seq), dtype)
        dst = memoryview(narrow.reshape(-1).view(np.uint8))
        d = lay.doc_of_span
        for at, w, a, k in zip(
            (lay.flat_start * item).tolist(),
            which[d].tolist(),
            ((first[d] + lay.rows.span_start) * item).tolist(),
            (n * item).tolist(),
        ):
            dst[at : at + k] = bufs[w][a : a + k]
        dst.release()
        block = _block(lay, alloc, into)
        np.copyto(block[0], narrow)
        return _finish(block, lay, keys, name=self.name, pad_id=self.pad_id, alloc=alloc)

    def _decoded(self, rows: Rows, lay: _Layout, alloc: Alloc, into: np.ndarray | None) -> dict[str, Any]:
        """Remote shards, or payloads that are not plain arrays: decode sample by sample."""
        field = self.reader.pad_field
        samples = self.reader.read_samples(lay.docs)
        if samples and not (field and isinstance(samples[0].get(field), np.ndarray)):
            raise FormatError(
                f"packing needs the length field to be a 1-D integer token array; "
                f"this dataset's length field is {field!r}"
            )
        return packed_batch(
            rows,
            lambda _: [s[field] for s in samples],
            self.packing,
            keys_of=lambda _: [s[KEY] for s in samples],
            name=self.name,
            pad_id=self.pad_id,
            rows_per_batch=lay.b,
            alloc=alloc,
            into=into,
        )

    def _scratch(self, shape: tuple, dtype: np.dtype) -> np.ndarray:
        need = int(np.prod(shape)) * dtype.itemsize
        if self._scratch_buf is None or self._scratch_buf.size < need:
            self._scratch_buf = np.empty(max(need, 1 << 20), np.uint8)
        return np.ndarray(shape, dtype, buffer=self._scratch_buf)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_scratch_buf": None}  # a worker makes its own


SOURCE_SHIFT = 40  # read_together's document ids: part i's sample g is (i << 40) + g


def read_together(
    parts: Sequence[tuple[PackedReader, Rows]], rows_per_batch: int, alloc: Alloc = np.empty
) -> dict[str, Any] | None:
    """One packed batch of the rows of several readers (a mixture's sources), part after part:
    one layout, one pass of token copies and one finish, as for the rows of one dataset. Uses the
    first reader's name, pad id and scratch. None when a part's tokens are not raw arrays in its
    mapped shards, or the parts store tokens in different dtypes (then read part by part)."""
    first_reader = parts[0][0]
    shifted = [
        dataclasses.replace(rows, span_pos=rows.span_pos + (i << SOURCE_SHIFT)) for i, (_, rows) in enumerate(parts)
    ]
    lay = _Layout(Rows.concat(shifted, first_reader.packing.seq_len), first_reader.packing, rows_per_batch)
    # The layout's sorted distinct documents are each part's, part after part (the shift): no
    # np.unique of its own per part.
    cuts = np.searchsorted(lay.docs, np.arange(1, len(parts), dtype=np.int64) << SOURCE_SHIFT).tolist()
    sources = []
    for i, ((reader, _), a, z) in enumerate(zip(parts, [0, *cuts], [*cuts, len(lay.docs)])):
        src = reader.reader.token_sources(lay.docs[a:z] - (i << SOURCE_SHIFT))
        if src is None:
            return None
        sources.append(src)
    if len({src[5] for src in sources}) != 1:
        return None
    keys, bufs, which = [], [], []
    for src in sources:
        keys += src[0]
        which.append(src[2] + len(bufs))
        bufs += src[1]
    joined = (
        keys,
        bufs,
        np.concatenate(which),
        np.concatenate([src[3] for src in sources]),
        np.concatenate([src[4] for src in sources]),
        sources[0][5],
    )

    def where(doc: int) -> str:
        part, gid = doc >> SOURCE_SHIFT, doc & ((1 << SOURCE_SHIFT) - 1)
        return parts[part][0].reader.where(gid)

    return first_reader._copied(lay, joined, alloc, None, where)


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
