"""Sequence packing: rows of exactly ``seq_len`` tokens built from spans of documents.

Files, each importing only those above it in this list:

- `config`   — the packing config (`Packing`), the rows it produces (`Rows`), row estimates
- `bestfit`  — best-fit decreasing of one window's documents (``best-fit``, ``no-split``)
- `rows`     — `pack_rows`: one window into rows under the config's policy (``concat`` here)
"""

from __future__ import annotations

from .bestfit import best_fit
from .config import (
    PACKING_VERSION,
    POLICIES,
    Packing,
    Rows,
    default_max_docs,
    piece_cap_note,
    rows_estimate,
    with_packed_eos,
)
from .rows import merge_rows, pack_rows, pack_windows

__all__ = [
    "PACKING_VERSION",
    "POLICIES",
    "Packing",
    "Rows",
    "best_fit",
    "default_max_docs",
    "merge_rows",
    "pack_rows",
    "pack_windows",
    "piece_cap_note",
    "rows_estimate",
    "with_packed_eos",
]
