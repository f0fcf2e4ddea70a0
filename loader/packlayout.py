"""Where every span of a packed batch goes: the layout `shardtool.loader.packed` writes a batch by."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..format import FormatError
from ..plan.packing import Packing, Rows


class BatchLayout:
    """Where every span of the batch goes in the flattened [B * S] batch. Its documents ``docs``:
    the sorted distinct ones, span k's being ``docs[doc_of_span[k]]``; or, ``per_span``, one per
    span (``docs`` is ``span_pos``, ``doc_of_span`` None): no sort per batch, and where the tokens
    lie comes per span with no gather (a document split across two rows is located twice)."""

    def __init__(self, rows: Rows, packing: Packing, rows_per_batch: int | None, *, per_span: bool = False):
        if rows.seq_len != packing.seq_len:
            raise ValueError(f"rows were packed for seq_len {rows.seq_len}, the batch is for {packing.seq_len}")
        b = rows.num_rows if rows_per_batch is None else int(rows_per_batch)
        if b < rows.num_rows:
            raise ValueError(f"{rows.num_rows} rows do not fit a batch of {b} rows")
        per_row = np.diff(rows.row_offsets)
        if rows.span_len.size and int(rows.span_len.min()) < 1:
            raise ValueError("a span of no tokens: every span must hold at least one token")
        maxd = packing.max_docs_per_row
        if maxd is None:
            raise RuntimeError("shardtool internal error: Packing.__post_init__ resolves None to its default")
        if per_row.size and int(per_row.max()) > maxd:
            raise ValueError(f"a row has {int(per_row.max())} pieces, more than max_docs_per_row {maxd}")
        seq = packing.seq_len
        if b * seq >= 2**31:
            raise ValueError(f"{b} rows of {seq} tokens overflow int32 cu_seqlens")
        self.b, self.seq, self.packing, self.rows = b, seq, packing, rows
        row_of, in_row = rows.span_places()
        self.flat_start = row_of * seq + in_row
        self.row_tokens = np.zeros(b, np.int64)
        self.row_tokens[: rows.num_rows] = rows.row_tokens()
        if (self.row_tokens > seq).any():
            raise ValueError(f"a row holds {int(self.row_tokens.max())} tokens, more than seq_len {seq}")
        self.docs: np.ndarray = rows.span_pos
        self.doc_of_span: np.ndarray | None = None
        if not per_span:
            self.docs, inverse = np.unique(rows.span_pos, return_inverse=True)
            self.doc_of_span = inverse.reshape(-1)
        self.eos_at: np.ndarray | None = None  # flat positions of eos tokens, set by copy_counts
        self.eos_doc: np.ndarray | None = None  # and the index in ``docs`` of the document each ends

    def copy_counts(self, counts: np.ndarray, where: Callable[[int], str]) -> np.ndarray:
        """Tokens to copy per span (the eos is written, not copied), checked against each
        document's stored token count ``counts`` (per document of ``docs``)."""
        rows, extra = self.rows, self.packing.extra_tokens
        n = self.of_span(counts)
        end = rows.span_start + rows.span_len
        bad = np.flatnonzero(end > n + extra)
        if bad.size:
            k = int(bad[0])
            raise FormatError(
                f"{where(int(self.of_span(self.docs)[k]))} has {int(n[k])} tokens, but the plan "
                f"packs its tokens up to {int(end[k])}{' (eos included)' if extra else ''}: "
                "lengths and data disagree"
            )
        self.eos_at = self.eos_doc = None
        if extra:
            eos = end == n + 1
            self.eos_at = self.flat_start[eos] + rows.span_len[eos] - 1
            self.eos_doc = self.doc_index()[eos]  # which document of ``docs`` each eos ends
        return np.minimum(rows.span_len, np.maximum(n - rows.span_start, 0))

    def doc_index(self) -> np.ndarray:
        """Per span, its document's index in ``docs``."""
        return self.of_span(np.arange(len(self.docs), dtype=np.int64))

    def copy_pieces(self, flat: np.ndarray, arrays: Sequence[Any], n: np.ndarray) -> None:
        """Each span's ``n`` elements of its document's array (``arrays``, per document of ``docs``)
        into its place in the flattened batch ``flat``: a packed batch's tokens decoded sample by
        sample, and each per-token field, are laid out alike."""
        spans = (self.flat_start, self.doc_index(), self.rows.span_start, n)
        for dst, d, a, k in zip(*(s.tolist() for s in spans)):
            flat[dst : dst + k] = arrays[d][a : a + k]

    def of_span(self, per_doc: np.ndarray) -> np.ndarray:
        """A value per document of ``docs`` as a value per span."""
        return per_doc if self.doc_of_span is None else per_doc[self.doc_of_span]

    def keys_per_row(self, keys: Sequence[Any]) -> list[list[Any]]:
        d = self.doc_of_span
        per_span = list(keys) if d is None else [keys[i] for i in d.tolist()]
        bounds = self.rows.row_offsets.tolist()
        return [per_span[a:z] for a, z in zip(bounds[:-1], bounds[1:])] + [
            [] for _ in range(self.b - self.rows.num_rows)
        ]


def lean_dtype(stored: np.dtype, *ids: int | None) -> np.dtype:
    """``input_ids``' dtype in a lean batch: int32 when every stored token fits (signed up to 32
    bits, unsigned up to 16) and so do the pad and eos ids ``ids``; else int64. Embedding layers
    take int32 indices; labels stay int64 (`lean_to_full`: cross_entropy refuses int32 targets)."""
    stored = np.dtype(stored)
    fits = (
        stored.kind == "b"
        or (stored.kind == "i" and stored.itemsize <= 4)
        or (stored.kind == "u" and stored.itemsize <= 2)
    )
    small = np.iinfo(np.int32)
    if fits and all(v is None or small.min <= int(v) <= small.max for v in ids):
        return np.dtype(np.int32)
    return np.dtype(np.int64)


def joined_runs(
    at: np.ndarray, which: np.ndarray, src: np.ndarray, size: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The copies (destination, buffer, source, bytes) of consecutive spans joined where one
    continues the other in both the batch and the same buffer: neighbouring documents whose
    tokens lie side by side in the shard (``stream`` rows, eos stored) are one copy, not one per
    document. The Python loop over copies is what a packed batch's CPU time grows with."""
    if len(at) < 2:
        return at, which, src, size
    joined = (which[1:] == which[:-1]) & (src[1:] == src[:-1] + size[:-1]) & (at[1:] == at[:-1] + size[:-1])
    if not joined.any():
        return at, which, src, size
    head = np.flatnonzero(np.concatenate([[True], ~joined]))
    return at[head], which[head], src[head], np.add.reduceat(size, head)


def copy_runs(ids: np.ndarray, narrow: np.ndarray, bufs: Sequence[Any], at, which, src, size) -> None:
    """The copies `joined_runs` gives (lists: run i is ``bufs[which[i]][src[i] : src[i] + size[i]]`` to
    byte ``at[i]`` of the batch) made into ``narrow``: ``ids`` itself where it has the stored
    dtype, else a scratch of it, widened into ``ids`` after. Raw-byte copies in the stored dtype
    (a memoryview slice assignment is a bare memcpy): one vectorised widening at the end is
    cheaper than a cast per piece. The one copy loop of every packed batch."""
    dst = narrow.reshape(-1).view(np.uint8).data  # memoryview(): numpy's stubs give __buffer__ from Python 3.12
    try:
        for t, w, f, k in zip(at, which, src, size):
            dst[t : t + k] = bufs[w][f : f + k]
    finally:
        dst.release()
    if narrow is not ids:
        np.copyto(ids, narrow)


@functools.lru_cache(maxsize=4)
def counting(n: int) -> np.ndarray:
    """0 .. n-1, read-only, kept: a fresh [B * S] arange per batch costs as much as the positions."""
    out = np.arange(n, dtype=np.int64)
    out.flags.writeable = False
    return out
