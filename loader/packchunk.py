"""Lean packed batches of a pass, laid out a chunk of batches at a time.

A packed batch's layout (where each piece goes, where its tokens lie, which copies join, its
``cu_seqlens``, ``doc_offsets`` and ``lengths``) follows from the plan alone. `PackedReader.read`
works it out per batch: some forty numpy calls, each a microsecond or more, which at 8 rows of
8,192 tokens cost as much as the copies themselves. Here it is worked out for ``CHUNK`` batches
at once, with the same calls over arrays ``CHUNK`` times longer, so a batch costs its allocation,
its copies (a Python loop over joined runs) and three small array copies. Lean outputs only (a
full batch's labels and positions are per-batch arithmetic anyway); the result is equal to
`PackedReader.read`'s, which is the fallback for any chunk this cannot lay out (tokens that are
not raw arrays in mapped shards, more shards than the reader keeps open) and for a batch whose
data disagrees with the plan (so its error names the batch it is in).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..plan.packing import Rows
from .collate import Alloc
from .packlayout import copy_runs, joined_runs, lean_dtype

CHUNK = 64  # batches laid out together: ~1 MB of layout at 8 x 8192


class LeanChunk:
    """Batches ``first .. first + count - 1`` of a pass (rows ``rows``, batch b's rows
    ``row_offsets[b] : row_offsets[b + 1]``) laid out for `shardtool.loader.packed.PackedReader`'s lean output."""

    def __init__(self, packed: Any, rows: Rows, row_offsets: np.ndarray, first: int, count: int):
        self.first = first  # (the reader is not kept: it keeps this chunk; `read` is given it)
        self.ok = False  # False: read each batch with PackedReader.read
        self.bad: set[int] = set()  # batches (of the pass) whose data disagrees with the plan
        packing, b, seq = packed.packing, int(packed.rows_per_batch or 0), packed.packing.seq_len
        r0, r1 = int(row_offsets[first]), int(row_offsets[first + count])
        rows = rows.slice(r0, r1)
        rows_per = np.diff(row_offsets[first : first + count + 1]).astype(np.int64)
        if b < 1 or (rows_per > b).any() or not len(rows.span_pos):
            return
        reader = packed.reader
        if not reader.by_view or reader.source.dataset.manifest.compression is not None:
            return  # compressed record batches may be dropped from memory while the chunk lasts
        # Every shard the chunk reads stays open while it lasts: within the reader's bound.
        if np.unique(reader.locate(rows.span_pos)[0]).size > reader.ctx.max_open // 2:
            return
        per_row = np.diff(rows.row_offsets)
        if int(per_row.max(initial=0)) > packing.max_docs_per_row or int(rows.span_len.min()) < 1:
            return  # PackedReader.read says what is wrong
        # Counted batch by batch as each is read (`read`), not the chunk's 64 at its layout.
        src = reader.token_sources(rows.span_pos, keys=False, spans=(rows.span_start, rows.span_len), counted=True)
        if src is None:
            return
        _, bufs, which, first_el, counts, dtype = src
        # Every row is a place in its batch: batch j's rows are places 0 .. rows_per[j] - 1.
        batch_of_row = np.repeat(np.arange(count, dtype=np.int64), rows_per)
        place = np.arange(len(per_row), dtype=np.int64) - np.repeat(np.cumsum(rows_per) - rows_per, rows_per)
        row_of = np.repeat(np.arange(len(per_row), dtype=np.int64), per_row)
        before = np.cumsum(rows.span_len) - rows.span_len
        flat_start = place[row_of] * seq + before - before[rows.row_offsets[row_of]]
        span_batch = batch_of_row[row_of]
        # The tokens each span copies; a span past its document's stored tokens is the plan and
        # the data disagreeing: those batches go through PackedReader.read, which names them.
        end = rows.span_start + rows.span_len
        extra = packing.extra_tokens
        self.bad = set((first + np.unique(span_batch[end > counts + extra])).tolist())
        n = np.minimum(rows.span_len, np.maximum(counts - rows.span_start, 0))
        item = dtype.itemsize
        self.elements = np.bincount(span_batch, weights=n, minlength=count).astype(np.int64)
        # The batch in the buffer index's high bits keeps runs from joining across batches.
        at, wb, a, k = joined_runs(
            flat_start * item, which + (span_batch << 32), (first_el + rows.span_start) * item, n * item
        )
        w = wb & 0xFFFFFFFF
        # Runs come in span order, so batch j's are a contiguous slice of them.
        self.run_cuts = np.searchsorted(wb >> 32, np.arange(count + 1)).tolist()
        self.runs = (at.tolist(), w.tolist(), a.tolist(), k.tolist())
        self.bufs = bufs
        self.dtype = lean_dtype(dtype, packed.pad_id, packing.eos_id)
        self.stored = dtype
        # Real tokens per place (rows missing from a short batch hold none).
        row_tokens = np.zeros((count, b), np.int64)
        tokens_of_row = np.add.reduceat(rows.span_len, rows.row_offsets[:-1]) if len(per_row) else per_row
        row_tokens[batch_of_row, place] = tokens_of_row
        self.lengths = row_tokens
        # Segments: every piece starts one; a place without tokens is one segment of padding.
        empty_batch, empty_place = np.nonzero(row_tokens == 0)
        seg_batch = np.concatenate([span_batch, empty_batch])
        seg_start = np.concatenate([flat_start, empty_place * seq])
        seg_doc_offset = np.concatenate([rows.span_start, np.full(empty_batch.size, -1, np.int64)])
        order = np.lexsort((seg_start, seg_batch))
        seg_batch, seg_start, seg_doc_offset = seg_batch[order], seg_start[order], seg_doc_offset[order]
        per_batch = np.bincount(seg_batch, minlength=count)
        seg_first = np.cumsum(per_batch) - per_batch
        rank = np.arange(seg_batch.size, dtype=np.int64) - seg_first[seg_batch]
        maxd = packing.max_docs_per_row
        self.cu = np.full((count, b * maxd + 1), b * seq, np.int32)
        self.cu[seg_batch, rank] = seg_start
        self.doc_offsets = np.full((count, b * maxd), -1, np.int64)
        self.doc_offsets[seg_batch, rank] = seg_doc_offset
        last = np.ones(seg_batch.size, dtype=bool)
        last[:-1] = seg_batch[1:] != seg_batch[:-1]
        seg_end = np.where(last, b * seq, np.append(seg_start[1:], 0))
        self.max_seqlen = np.maximum.reduceat(seg_end - seg_start, seg_first).tolist()
        # Batch j's eos positions and padded row tails, as slices of the chunk's arrays.
        eos_span = end == counts + 1 if extra else np.zeros(len(end), dtype=bool)
        self.eos_at = flat_start[eos_span] + rows.span_len[eos_span] - 1
        self.eos_cuts = np.searchsorted(span_batch[eos_span], np.arange(count + 1)).tolist()
        pad_b, pad_place = np.nonzero(row_tokens < seq)
        self.pads: list[list[tuple[int, int]]] = [[] for _ in range(count)]  # per batch: (start, stop) of each row tail
        for j, p, t in zip(pad_b.tolist(), pad_place.tolist(), row_tokens[pad_b, pad_place].tolist()):
            self.pads[j].append((p * seq + t, (p + 1) * seq))
        self.ok = True

    def read(self, packed: Any, j: int, alloc: Alloc) -> dict[str, Any]:
        """Batch ``first + j`` of the chunk, read by ``packed`` (the reader it was laid out for),
        equal to `PackedReader.read`'s lean batch."""
        b, seq = self.lengths.shape[1], packed.packing.seq_len
        packed.reader.count_pieces(self.elements[j : j + 1], self.stored)
        ids = alloc((b, seq), self.dtype)
        narrow = ids if ids.dtype == self.stored else packed.scratch.array((b, seq), self.stored)
        lo, hi = self.run_cuts[j], self.run_cuts[j + 1]
        copy_runs(ids, narrow, self.bufs, *(r[lo:hi] for r in self.runs))
        flat = ids.reshape(-1)
        if self.eos_cuts[j + 1] > self.eos_cuts[j]:
            flat[self.eos_at[self.eos_cuts[j] : self.eos_cuts[j + 1]]] = packed.packing.eos_id
        pad = packed.pad_id
        for x, y in self.pads[j]:
            flat[x:y] = pad
        cu = alloc(self.cu.shape[1], np.int32)
        cu[:] = self.cu[j]
        lengths = alloc(b, np.int64)
        lengths[:] = self.lengths[j]
        doc_offsets = alloc(self.doc_offsets.shape[1], np.int64)
        doc_offsets[:] = self.doc_offsets[j]
        return {
            packed.name: torch.from_numpy(ids),
            "cu_seqlens": torch.from_numpy(cu),
            "max_seqlen": self.max_seqlen[j],
            "lengths": torch.from_numpy(lengths),
            "doc_offsets": torch.from_numpy(doc_offsets),
        }
