"""Sequence packing: one shuffle window's documents into rows of exactly ``seq_len`` tokens.

A row is a list of spans (document, first token, token count). Pure numpy, no I/O: the plan knows
every length before the first batch, so packing is a deterministic function of the window's
lengths and the `Packing` config, and a saved position resumes exactly.

Policies:
- ``concat``: the window's documents back to back, cut every ``seq_len`` tokens; a document
  continues in the next row. Padding only in the window's last row (and in a row closed early by
  ``max_docs_per_row``).
- ``stream``: ``concat`` over the group's documents in storage order, not shuffled (one window:
  the stored token stream cut every ``seq_len`` tokens); only the rows are shuffled, as LitData's
  ``TokensLoader`` and Megatron's GPT datasets cut theirs. A row's tokens then lie side by side in
  the shard (one copy per row, not one per document, where the documents end with their eos as
  stored), at the price of rows whose documents were neighbours in storage.
- ``best-fit``: best-fit decreasing of whole documents into rows; only documents longer than
  ``seq_len`` are cut, into ``seq_len``-token pieces (a row each) and a tail packed like a document.
- ``no-split``: like ``best-fit``, but documents longer than ``seq_len`` are dropped (``Rows.dropped``).

With ``eos_id`` set every document is one token longer (the end-of-sequence token the batch
builder appends), and spans count it: a span ending at the document's last position covers it.
Documents of no tokens at all (length 0, no ``eos_id``) get no span and are not counted as dropped.

Rows come out in the order they were opened (for best-fit: by their largest piece, largest
first), so the caller shuffles them, as bucketing shuffles its batches.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, replace

import numpy as np

from ..arrays import gather_runs

__all__ = [
    "NO_SPLIT_VERSION",
    "PACKING_VERSION",
    "POLICIES",
    "Packing",
    "Rows",
    "default_max_docs",
    "piece_cap_note",
    "rows_estimate",
    "with_packed_eos",
]

# Bumped whenever packing changes the rows it produces, so a saved position is never replayed
# against different rows.
PACKING_VERSION = 2
# Bumped when no-split's batch counts change (2: counted from the documents' lengths, so every
# document is served; 2026-12-07). Folded into no-split's fingerprint only, so a mid-epoch position
# of an older no-split plan is refused as another plan version, and other policies keep theirs.
NO_SPLIT_VERSION = 2
POLICIES = ("concat", "best-fit", "no-split", "stream")


def default_max_docs(seq_len: int) -> int:
    """Pieces a row may hold by default: binds only where documents average < 32 tokens (or, below
    2,048-token rows, < 64 rows' worth of 32 tokens), while keeping ``cu_seqlens`` small."""
    return min(seq_len, max(64, seq_len // 32))


def _int_at_least(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, found {value!r}")


@dataclass(frozen=True)
class Packing:
    """How documents become rows of exactly ``seq_len`` tokens.

    ``max_docs_per_row`` bounds the pieces of documents in one row, so a batch's ``cu_seqlens``
    has a static shape (``rows * max_docs_per_row + 1``); a row that reaches it is closed (padded).
    Default: `default_max_docs` (``seq_len // 32``, at least 64, at most ``seq_len``).
    """

    seq_len: int
    policy: str = "best-fit"
    eos_id: int | None = None
    max_docs_per_row: int | None = None

    def __post_init__(self) -> None:
        _int_at_least("seq_len", self.seq_len, 1)
        if self.policy not in POLICIES:
            raise ValueError(f"packing policy must be one of {', '.join(POLICIES)}; found {self.policy!r}")
        if self.eos_id is not None:
            _int_at_least("eos_id", self.eos_id, 0)
        if self.max_docs_per_row is None:
            object.__setattr__(self, "max_docs_per_row", default_max_docs(int(self.seq_len)))
        _int_at_least("max_docs_per_row", self.max_docs_per_row, 1)
        for name in ("seq_len", "max_docs_per_row", "eos_id"):  # numpy ints -> int: JSON, hashing
            v = getattr(self, name)
            if v is not None:
                object.__setattr__(self, name, int(v))

    @property
    def extra_tokens(self) -> int:
        """Tokens packing adds to every document (the eos token)."""
        return 0 if self.eos_id is None else 1

    def cut_to(self, seq_len: int) -> Packing:
        """The config of its rows cut to ``seq_len`` tokens (`shardtool.plan.rowsplit.cut_rows`):
        the same pieces at most a row, since a cut row holds parts of its row's pieces."""
        return replace(self, seq_len=seq_len)

    def fingerprint(self) -> str:
        """Stable short hex id of this config and of the packing algorithm version."""
        fields = {"packing_version": PACKING_VERSION, **asdict(self)}
        if self.policy == "no-split":
            fields["no_split_version"] = NO_SPLIT_VERSION
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]


@dataclass(frozen=True, eq=False)
class Rows:
    """Rows of one window, stored flat: row r is spans ``row_offsets[r] : row_offsets[r + 1]``.

    Span k is tokens ``span_start[k] : span_start[k] + span_len[k]`` of document ``span_pos[k]``
    (its position in the input; the eos token, when packed, is a document's last token). Within a
    row, spans are in input order. ``dropped``: positions of documents ``no-split`` left out;
    ``split_docs``: documents cut into more than one span. All arrays int64.
    """

    seq_len: int
    row_offsets: np.ndarray
    span_pos: np.ndarray
    span_start: np.ndarray
    span_len: np.ndarray
    dropped: np.ndarray
    split_docs: int

    @property
    def num_rows(self) -> int:
        return len(self.row_offsets) - 1

    @property
    def tokens(self) -> int:
        """Real tokens in all rows (eos counted, padding not)."""
        return int(self.span_len.sum())

    def at_piece_cap(self, packing: Packing) -> int:
        """Rows holding ``packing.max_docs_per_row`` pieces, closed there (`piece_cap_note`)."""
        return int(np.count_nonzero(np.diff(self.row_offsets) >= (packing.max_docs_per_row or 0)))

    def row_tokens(self) -> np.ndarray:
        """Real tokens per row."""
        before = np.zeros(len(self.span_len) + 1, np.int64)
        np.cumsum(self.span_len, out=before[1:])
        return before[self.row_offsets[1:]] - before[self.row_offsets[:-1]]

    def span_places(self) -> tuple[np.ndarray, np.ndarray]:
        """Per span: its row, and the position of its first token in that row."""
        row_of = np.repeat(np.arange(self.num_rows, dtype=np.int64), np.diff(self.row_offsets))
        before = np.cumsum(self.span_len) - self.span_len
        return row_of, (before - before[self.row_offsets[row_of]] if row_of.size else before)

    def fill_rate(self) -> float:
        """Real tokens / row tokens (1.0 for no rows)."""
        return self.tokens / (self.num_rows * self.seq_len) if self.num_rows else 1.0

    def take(self, rows: np.ndarray) -> Rows:
        """These rows (indices, in the given order), e.g. one batch's; ``dropped``/``split_docs`` kept."""
        rows = np.asarray(rows, dtype=np.int64)
        begin = self.row_offsets[rows]
        sizes = self.row_offsets[rows + 1] - begin
        idx = gather_runs(np.arange(len(self.span_pos), dtype=np.int64), begin, sizes)
        offsets = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(sizes, out=offsets[1:])
        return Rows(
            self.seq_len,
            offsets,
            self.span_pos[idx],
            self.span_start[idx],
            self.span_len[idx],
            self.dropped,
            self.split_docs,
        )

    def slice(self, first: int, stop: int) -> Rows:
        """Rows ``first .. stop-1`` as views (no copy): a batch's rows, per batch, on the hot path."""
        lo, hi = int(self.row_offsets[first]), int(self.row_offsets[stop])
        return Rows(
            self.seq_len,
            self.row_offsets[first : stop + 1] - lo,
            self.span_pos[lo:hi],
            self.span_start[lo:hi],
            self.span_len[lo:hi],
            self.dropped,
            self.split_docs,
        )

    @classmethod
    def concat(cls, parts: list[Rows], seq_len: int) -> Rows:
        """The rows of ``parts``, in order; ``dropped`` and ``split_docs`` added up."""
        if not parts:
            empty = np.zeros(0, np.int64)
            return cls(seq_len, np.zeros(1, np.int64), empty, empty, empty, empty, 0)
        spans = np.cumsum([0, *(len(p.span_pos) for p in parts)])
        offsets = np.concatenate([[0], *(p.row_offsets[1:] + s for p, s in zip(parts, spans[:-1]))])
        return cls(
            seq_len,
            offsets.astype(np.int64),
            *(
                np.concatenate([getattr(p, k) for p in parts])  # type: ignore[call-arg, arg-type]  # mypy cannot count a starred generator's fields
                for k in ("span_pos", "span_start", "span_len", "dropped")
            ),
            sum(p.split_docs for p in parts),
        )

    def with_ids(self, ids: np.ndarray) -> Rows:
        """The same rows with positions mapped through ``ids`` (e.g. window position -> global id)."""
        ids = np.asarray(ids, dtype=np.int64)
        return Rows(
            self.seq_len,
            self.row_offsets,
            ids[self.span_pos],
            self.span_start,
            self.span_len,
            ids[self.dropped],
            self.split_docs,
        )


def rows_estimate(
    token_count: int,
    doc_count: int,
    packing: Packing,
    *,
    windows: int = 1,
    too_long: tuple[int, int] | None = None,
    short: tuple[float, float] | None = None,
    half: float | None = None,
) -> float:
    """Expected rows for ``doc_count`` documents of ``token_count`` tokens (as stored; the eos is
    added here), packed in ``windows`` windows.

    ``concat``: exact for one window, ceil(tokens / seq_len), unless ``max_docs_per_row`` binds;
    over several windows each window's last row is on average half empty. ``stream`` is packed
    as one window whatever ``windows`` says. ``best-fit``: rows are
    close to full (fill ~0.999 on text-like lengths), so the same count plus the last, partly
    filled rows of each window. ``no-split`` drops the documents longer than a row: give
    ``too_long`` = (documents, tokens) of those (length + eos > seq_len, e.g. from a length
    histogram with an edge there); without it the estimate counts them as packed. ``short`` =
    (documents, tokens) of those so short that ``max_docs_per_row`` of them fill less than a row
    (length + eos < seq_len / max_docs_per_row): best-fit closes rows on the piece bound as well
    as on tokens, and such a document takes 1 / max_docs_per_row of a row, not its tokens' share
    (on the stdlib's lines at rows of 2,048, 9% more rows than tokens / seq_len). ``half``: for
    no-split, the documents that fit a row but are longer than half of one (length + eos >
    seq_len / 2): no two share a row, so there are at least as many rows (images of 576
    placeholders and a caption, at rows of 1,024: a row each, twice their tokens' count).
    """
    _int_at_least("token_count", token_count, 0)
    _int_at_least("doc_count", doc_count, 0)
    _int_at_least("windows", windows, 1)
    if packing.policy == "no-split" and too_long is not None:
        long_docs, long_tokens = too_long
        _int_at_least("too_long documents", long_docs, 0)
        _int_at_least("too_long tokens", long_tokens, 0)
        if long_docs > doc_count or long_tokens > token_count:
            raise ValueError(f"too_long {too_long} exceeds the totals ({doc_count} documents, {token_count} tokens)")
        doc_count, token_count = doc_count - long_docs, token_count - long_tokens
    tokens = int(token_count) + int(doc_count) * packing.extra_tokens
    if tokens == 0:
        return 0.0
    seq = packing.seq_len
    # Rows the piece bound alone needs (it cannot bind when a row holds seq_len pieces of >= 1 token).
    maxd = packing.max_docs_per_row
    if maxd is None:
        raise RuntimeError("shardtool internal error: Packing.__post_init__ resolves None to default_max_docs")
    pieces_bound = doc_count / maxd if maxd < seq else 0.0
    if packing.policy in ("concat", "stream"):
        if windows == 1 or packing.policy == "stream":
            return float(max(math.ceil(tokens / seq), math.ceil(pieces_bound)))
        return max(tokens / seq + 0.5 * (windows - 1), pieces_bound)
    # Best-fit: all rows but a window's last few are (nearly) full; one extra row per window. A
    # document takes the larger of its tokens' share and its piece's share of a row.
    tokens_rows = tokens / seq
    if short is not None and maxd < seq:
        short_docs, short_tokens = short
        tokens_rows = (tokens - short_tokens - short_docs * packing.extra_tokens) / seq + short_docs / maxd
    if half is not None and packing.policy == "no-split":
        tokens_rows = max(tokens_rows, float(half))
    return max(tokens_rows + windows, pieces_bound)


def piece_cap_note(capped: int, rows: int, tokens: int, packing: Packing) -> str | None:
    """What to do where ``max_docs_per_row`` closed most rows short of ``seq_len``: ``capped`` of
    ``rows`` rows hold that many pieces, ``tokens`` real tokens in all. None where it costs little
    (rows over 90% full, or under half of them at the cap). Documents of a few tokens (captions,
    short chat turns) fill a row's pieces long before its tokens, and nothing else said so."""
    maxd = packing.max_docs_per_row
    fill = tokens / (rows * packing.seq_len) if rows else 1.0
    if maxd is None or not rows or fill >= 0.9 or capped * 2 < rows:
        return None
    return (
        f"{capped / rows:.0%} of the rows hold max_docs_per_row={maxd} pieces of documents and close there, "
        f"{fill:.0%} full: give max_docs_per_row a larger value (--max-docs-per-row; cu_seqlens grows with it) "
        "to put more documents in a row"
    )


def with_packed_eos(packing: Packing | None, packed_eos: dict[str, int | None]) -> Packing | None:
    """The packing a loader uses on datasets whose documents may already end with an EOS token.

    ``packed_eos`` maps each dataset (its URL or name) to the ``eos_id`` that ``shardtool pack
    --eos-id`` appended to every document (the manifest's ``length.eos_id``), or None. Asking for
    that same ``eos_id`` again would end every document with two: the loader appends none
    (returns the packing without ``eos_id``). Another id, or datasets of which only some carry
    the id, cannot be made consistent: ValueError saying why and what to change.
    """
    if packing is None or packing.eos_id is None:
        return packing
    carried = {name: eos for name, eos in packed_eos.items() if eos is not None}
    if not carried:
        return packing
    other = {name: eos for name, eos in carried.items() if eos != packing.eos_id}
    if other:
        name, eos = next(iter(other.items()))
        raise ValueError(
            f"{name}: its documents already end with EOS id {eos} (packed with --eos-id {eos}); "
            f"eos_id={packing.eos_id} would add a second, different end token. Drop eos_id (the "
            f"packed one is used), or repack with --eos-id {packing.eos_id}"
        )
    bare = sorted(name for name, eos in packed_eos.items() if eos is None)
    if bare:
        raise ValueError(
            f"eos_id={packing.eos_id}: {', '.join(sorted(carried))} already end every document "
            f"with it (packed with --eos-id) and {', '.join(bare)} do not, so one eos_id cannot "
            "end every document once; repack those with --eos-id, or without it"
        )
    return replace(packing, eos_id=None)
