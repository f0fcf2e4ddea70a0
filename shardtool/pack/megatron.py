"""A Megatron/NeMo indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``) as a pack source.

Read from the documented ``MMIDIDX`` format directly (megatron-core's
``datasets/indexed_dataset.py``), without megatron-core or torch:

    .idx: b"MMIDIDX\\x00\\x00", version <Q (1), dtype code <B, sequence count <Q (S),
          document-index count <Q (D), int32 sequence lengths [S], int64 byte pointers [S],
          int64 document indices [D] (D - 1 documents; document d is sequences
          doc[d]..doc[d+1]), then, in multimodal datasets only, int8 sequence modes [S]
    .bin: the tokens of every sequence, in order, in the dtype of the code

Each *document* becomes one sample with one field, ``tokens`` (a 1-D array of the index's
dtype: the sentences of a ``--split-sentences`` document are joined). Lengths come from the
``.idx`` (the offsets of the list column): the tokens are read only to be written, never to be
measured. A ``.bin`` shorter or longer than the ``.idx`` says, pointers that do not follow the
lengths, or a document index that is not monotonic are errors naming the file.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator

import numpy as np

from ..format.errors import BadSampleError
from .workunit import Unit

HEADER = b"MMIDIDX\x00\x00"
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
FIELD = "tokens"
UNIT_DOCS = 65536  # documents per unit: as an Arrow file's unit, so row groups of this size pack alike
BATCH_DOCS = 8192  # documents per record batch: as a Parquet row group is read


def prefix_of(src: str) -> str | None:
    """The PREFIX of a Megatron dataset named by PREFIX, PREFIX.bin or PREFIX.idx, or None."""
    for suffix in (".idx", ".bin"):
        if src.endswith(suffix):
            src = src[: -len(suffix)]
            break
    if os.path.isfile(src + ".idx") and (os.path.isfile(src + ".bin") or src.endswith(".idx")):
        return src
    return None


class MegatronIndex:
    """The parsed ``.idx`` of PREFIX, checked against the size of ``.bin``."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        idx, bin_ = prefix + ".idx", prefix + ".bin"
        try:
            raw = np.memmap(idx, mode="r", dtype=np.uint8) if os.path.getsize(idx) else np.zeros(0, np.uint8)
            bin_size = os.path.getsize(bin_)
        except FileNotFoundError as e:
            raise BadSampleError(
                f"missing {e.filename} (a Megatron dataset is PREFIX.bin + PREFIX.idx)", source=prefix
            ) from None
        buf = bytes(raw[:34])
        if len(buf) < 34 or buf[:9] != HEADER:
            raise BadSampleError("not a Megatron MMIDIDX index (bad header)", source=idx)
        version, code, seqs, docs = struct.unpack("<QBQQ", buf[9:34])
        if version != 1:
            raise BadSampleError(f"MMIDIDX version {version} is not supported (expected 1)", source=idx)
        if code not in DTYPES:
            raise BadSampleError(f"unknown dtype code {code}", source=idx)
        self.dtype = np.dtype(DTYPES[code])
        need = 34 + 12 * seqs + 8 * docs
        if len(raw) == need + seqs and seqs:
            raise BadSampleError("a multimodal index (sequence modes) is not supported", source=idx)
        if len(raw) != need:
            raise BadSampleError(
                f"index is {len(raw)} bytes, its header declares {seqs} sequences and {docs} "
                f"document indices ({need} bytes): truncated or not this format",
                source=idx,
            )
        self.lengths = np.frombuffer(raw, np.int32, seqs, 34)
        self.pointers = np.frombuffer(raw, np.int64, seqs, 34 + 4 * seqs)
        self.doc_index = np.frombuffer(raw, np.int64, docs, 34 + 12 * seqs)
        item = self.dtype.itemsize
        expected = np.zeros(seqs + 1, np.int64)
        np.cumsum(self.lengths.astype(np.int64) * item, out=expected[1:])
        if seqs and (int(self.lengths.min()) < 0 or not np.array_equal(self.pointers, expected[:-1])):
            bad = int(np.flatnonzero((self.pointers != expected[:-1]) | (self.lengths < 0))[0])
            raise BadSampleError(
                f"sequence {bad}: its pointer {int(self.pointers[bad])} does not follow the "
                f"lengths before it ({int(expected[bad])}): the .idx does not match its .bin",
                source=idx,
            )
        if (
            len(self.doc_index) < 1
            or self.doc_index[0] != 0
            or self.doc_index[-1] != seqs
            or (len(self.doc_index) > 1 and int(np.diff(self.doc_index).min()) < 0)
        ):
            raise BadSampleError(f"document indices do not run from 0 to {seqs} in order", source=idx)
        # token offset of every document's start, and of the end
        self.doc_tokens = (expected // item)[self.doc_index]
        if bin_size != int(expected[-1]):
            what = "truncated" if bin_size < expected[-1] else "longer than its index says"
            doc = self.document_of_byte(bin_size) if bin_size < expected[-1] else None
            at = f" (ends inside document {doc})" if doc is not None else ""
            raise BadSampleError(
                f"{bin_} is {bin_size} bytes, its .idx says {int(expected[-1])}: {what}{at}", source=bin_
            )

    @property
    def documents(self) -> int:
        return len(self.doc_index) - 1

    def document_of_byte(self, byte: int) -> int:
        return int(np.searchsorted(self.doc_tokens * self.dtype.itemsize, byte, side="right")) - 1


_OPEN: dict[tuple, MegatronIndex] = {}  # per process (forked workers inherit the parent's)


def open_index(prefix: str) -> MegatronIndex:
    """The checked index of PREFIX, parsed once per process and file version."""
    key = tuple(
        (os.stat(prefix + ext).st_mtime_ns, os.stat(prefix + ext).st_size) if os.path.exists(prefix + ext) else None
        for ext in (".idx", ".bin")
    )
    index = _OPEN.get((prefix, key))
    if index is None:
        index = _OPEN[(prefix, key)] = MegatronIndex(prefix)
    return index


def megatron_units(src: str) -> list[Unit]:
    prefix = prefix_of(src) or src
    index = open_index(prefix)
    n = index.documents
    item = index.dtype.itemsize
    return [
        Unit(
            "megatron",
            prefix,
            a,
            min(n, a + UNIT_DOCS),
            min(n, a + UNIT_DOCS) - a,
            0,
            max(int(index.doc_tokens[min(n, a + UNIT_DOCS)] - index.doc_tokens[a]) * item, 1),
        )
        for a in range(0, n, UNIT_DOCS)
    ]


def megatron_batches(unit: Unit) -> Iterator:
    """Record batches (one list column, ``tokens``) of documents [start, stop) of the unit."""
    import pyarrow as pa

    index = open_index(unit.path)
    tokens = (
        np.memmap(unit.path + ".bin", mode="r", dtype=index.dtype) if index.doc_tokens[-1] else np.zeros(0, index.dtype)
    )
    for a in range(unit.start, unit.stop, BATCH_DOCS):
        b = min(unit.stop, a + BATCH_DOCS)
        bounds = index.doc_tokens[a : b + 1]
        values = np.asarray(tokens[bounds[0] : bounds[-1]])
        offsets = bounds - bounds[0]
        list_type = pa.large_list if offsets[-1] >= 1 << 31 else pa.list_
        arr = (
            pa.ListArray.from_arrays(
                pa.array(offsets.astype(np.int32 if list_type is pa.list_ else np.int64)), pa.array(values)
            )
            if list_type is pa.list_
            else pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))
        )
        yield pa.RecordBatch.from_arrays([arr], [FIELD])
