"""What a packed batch holds, by its own fields: the pieces' rows, keys and offsets."""

from __future__ import annotations


def packed_pieces(batch) -> list[tuple[int, str, int]]:
    """(row, key, offset of the piece's first token in its document) of every piece, in order."""
    offs, out, k = batch["doc_offsets"].tolist(), [], 0
    for r, keys in enumerate(batch["__key__"]):
        for key in keys:
            out.append((r, str(key), offs[k]))
            k += 1
    return out


def piece_lengths(batch) -> list[tuple[str, int, int]]:
    """(key, offset in its document, length) of every document piece of a full packed batch."""
    cu, offsets = batch["cu_seqlens"].tolist(), batch["doc_offsets"].tolist()
    seq = batch["input_ids"].shape[1]
    ends = [r * seq + int(n) for r, n in enumerate(batch["lengths"].tolist())]
    keys = [k for row in batch["__key__"] for k in row]
    out = []
    for i, off in enumerate(o for o in offsets if o >= 0):
        out.append((keys[i], off, min(cu[i + 1], ends[cu[i] // seq]) - cu[i]))
    return out
