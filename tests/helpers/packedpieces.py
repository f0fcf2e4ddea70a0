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
