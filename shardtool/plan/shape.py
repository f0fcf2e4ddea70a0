"""The shape of an epoch's plan: what every rank computes alike, from the per-shard summaries only.

Group ranges, the shuffle window and the number of batches every DP rank serves depend on the
O(shards) summaries, the data layout and the batching config — never on any per-sample array —
so 8,192 ranks agree on them without communicating, each at the cost of reading the summaries.

Batch counts: in ``batch_size`` mode a group's count is exact (ceil(samples / batch_size): its
windows are multiples of the batch size). In ``max_tokens`` mode it is estimated from the group's
length histogram: a batch opened at a sample of length L holds floor(max_tokens / L) samples,
so a window holds about sum(count_bin / floor(max_tokens / mean_bin)) batches, plus half a batch
for its last one. Without bucketing (``shuffle=False``) batches are cut in dataset order: one data
group's count is exact (its lengths are read, as its plan reads them anyway), several groups'
are estimated from the summaries (`plan.inorder`); shuffled without bucketing, from each group's
histogram in random order. The estimate only chooses the per-rank count; each group then fits its real
batches to it (splitting, or dropping a rotating remainder), so a wrong estimate can never break
equal counts — it shows as a larger remainder, which `shardtool plan` reports.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..format.summaries import ShardSummaries
from .balance import MAX_DROP, batches_per_rank
from .batching import Batching, block_samples, bucket, in_order_starts, resolve_window
from .binrows import BIN_HIGH, BIN_LOW, histogram_rows, over_a_row
from .capacity import inverse_capacity
from .grouphist import group_histograms
from .inorder import inorder_batches, rate_from_histogram
from .layout import DataLayout
from .nosplit import fragmentation, whole_document_rows
from .packing import pack_windows
from .ranges import group_cuts

__all__ = ["PlanShape", "plan_shape", "shard_namer"]

IN_ORDER_MARGIN = 1.05  # several groups' in-order counts are estimated this much long (see below)


@dataclass(frozen=True, eq=False)
class PlanShape:
    data_layout: DataLayout
    batching: Batching
    cuts: np.ndarray  # [G + 1] sample cut points
    window: int
    batches_per_rank: int
    group_samples: np.ndarray  # [G] exact
    group_tokens: np.ndarray  # [G] exact up to the partial boundary shards (pro rata)
    group_batches: np.ndarray  # [G] exact (batch_size) or estimated (max_tokens) batches before fitting

    @property
    def group_sizes(self) -> np.ndarray:
        return np.asarray(self.data_layout.group_sizes, dtype=np.int64)


def _estimate_batches(
    count: np.ndarray, tokens: np.ndarray, squares: np.ndarray, samples: np.ndarray, batching: Batching, window: int
) -> np.ndarray:
    """Bucketed or packed batches per group (in-order cuts are `_in_order_batches`')."""
    windows = -(-samples // window)
    if batching.shuffle_block is not None and batching.shuffle:
        # Windows are cut in each block: whole blocks' windows, then the last block's.
        block = block_samples(batching)
        whole, rest = samples // block, samples % block
        windows = whole * -(-block // window) + -(-rest // window)
    if batching.packing is not None:
        return _estimate_packed(count, tokens, samples, windows, batching)
    if batching.batch_size is not None:
        return -(-samples // batching.batch_size)
    budget = batching.max_tokens
    total_count, total_tokens, total_squares = count.sum(axis=0), tokens.sum(axis=0), squares.sum(axis=0)
    mean = np.divide(total_tokens, total_count, out=np.zeros_like(total_tokens), where=total_count > 0)
    variance = np.maximum(
        np.divide(total_squares, total_count, out=np.zeros_like(total_squares), where=total_count > 0) - mean**2, 0.0
    )
    share = total_count / max(total_count.sum(), 1)
    # Samples sorted together: a window, or a whole group smaller than one.
    sorted_together = float(np.median(samples / np.maximum(windows, 1))) if samples.size else float(window)
    return count @ inverse_capacity(mean, variance, share, sorted_together, budget) + 0.5 * windows


def _in_order_batches(
    summaries: ShardSummaries,
    cuts: np.ndarray,
    count: np.ndarray,
    tokens: np.ndarray,
    squares: np.ndarray,
    batching: Batching,
    lengths_of: Callable[[int, int], np.ndarray] | None,
) -> np.ndarray:
    """Batches per group of a greedy cut in order under the token budget (no bucketing). One
    group in dataset order: its exact count, from its lengths (every rank reads the same ones).
    Several: estimated from the summaries, O(shards), since a rank reads only its group's lengths."""
    budget = int(batching.max_tokens)
    samples = np.diff(cuts)
    if batching.shuffle:  # each epoch a new random order: the count of a random order
        rates = rate_from_histogram(count, tokens, squares, budget)
        return np.where(samples > 0, samples * rates + 0.5, 0.0)
    if lengths_of is not None and samples.size == 1:
        lengths = np.asarray(lengths_of(int(cuts[0]), int(cuts[1])), dtype=np.int64)
        return np.array([float(in_order_starts(lengths, batching).size if lengths.size else 0)])
    # The estimate misses by a few percent either way on real orders (lognormal at 8,192: -1.3%;
    # stdlib files in their order: +6%). Short, a group drops samples; over, it splits batches
    # (each within the budget). An in-order pass is most often an evaluation, where every
    # sample counts: err long.
    return inorder_batches(summaries, cuts, budget) * IN_ORDER_MARGIN


def _stream_batches(
    batching: Batching, cuts: np.ndarray, lengths_of: Callable[[int, int], np.ndarray] | None
) -> np.ndarray | None:
    """``stream`` rows of one data group: the group cut in storage order, whatever the seed, so
    its rows are counted exactly from its lengths (every rank reads the same ones), and the count
    needs no room for the worst order (`_rows_to_serve_all`), whose spare batches were rows of
    padding (0.42% of the rows on 200k lognormal documents at 8,192). None otherwise."""
    packing = batching.packing
    if packing is None or packing.policy != "stream" or lengths_of is None or len(cuts) != 2:
        return None
    from .packing import pack_rows

    lengths = np.asarray(lengths_of(int(cuts[0]), int(cuts[1])), dtype=np.int64)
    return np.array([pack_rows(lengths, packing).num_rows / batching.batch_size if lengths.size else 0.0])


def _one_window_batches(
    batching: Batching, cuts: np.ndarray, lengths_of: Callable[[int, int], np.ndarray] | None
) -> np.ndarray | None:
    """A token budget's bucketed batches of one data group that serves every sample: the count of
    the group sorted as one window (the fewest batches its lengths allow, which a plan whose
    windows need more than the count falls back to: `shardtool.plan.group`), so the count is
    never short of it. An estimate alone was short on small groups (442 samples, 2 batches) and
    now and then on larger ones (0.3-1.3% of the samples left out on one rank). None otherwise."""
    if (
        batching.max_tokens is None
        or batching.packing is not None
        or not batching.bucketing
        or batching.shuffle_block is not None
        or lengths_of is None
        or len(cuts) != 2
    ):
        return None
    lengths = np.asarray(lengths_of(int(cuts[0]), int(cuts[1])), dtype=np.int64)
    if not lengths.size:
        return None
    ids = np.arange(lengths.size, dtype=np.int64)
    _, starts = bucket(ids, lengths, batching, int(lengths.size), None)
    return np.array([float(starts.size - 1)])


def _exact_batches(
    batching: Batching, cuts: np.ndarray, lengths_of: Callable[[int, int], np.ndarray] | None, window: int
) -> np.ndarray:
    """Every group's exact count: of bucketed batches, its range sorted (or, unbucketed, cut in
    order) as one window; of packed rows in storage order, its windows packed. With ``batch_size``
    bucketed, from the summaries; else from every group's lengths (each rank reads them all: an
    exact plan is an evaluation's, O(dataset)). Packed rows of a shuffled order are not counted
    here: they take the bound of any order (`_rows_to_serve_all`)."""
    samples = np.diff(cuts)
    if batching.batch_size is not None and batching.packing is None:
        return (-(-samples // batching.batch_size)).astype(np.float64)
    if lengths_of is None:
        raise ValueError("an exact plan counts its batches from the lengths: give the plan source's lengths")
    out = np.zeros(samples.size, dtype=np.float64)
    for g in range(samples.size):
        lengths = np.asarray(lengths_of(int(cuts[g]), int(cuts[g + 1])), dtype=np.int64)
        if not lengths.size:
            continue
        if batching.packing is not None:
            ids = np.arange(lengths.size, dtype=np.int64)
            out[g] = pack_windows(lengths, ids, batching.packing, window).num_rows / batching.batch_size
        elif batching.bucketing:
            _, starts = bucket(np.arange(lengths.size, dtype=np.int64), lengths, batching, int(lengths.size), None)
            out[g] = starts.size - 1
        else:
            out[g] = in_order_starts(lengths, batching).size
    return out


def _estimate_packed(
    count: np.ndarray, tokens: np.ndarray, samples: np.ndarray, windows: np.ndarray, batching: Batching
) -> np.ndarray:
    """Batches of packed rows: each group's rows (`shardtool.plan.binrows.histogram_rows`, from
    its histogram) over rows per batch."""
    rows = [
        histogram_rows(count[g], tokens[g], int(samples[g]), int(windows[g]), batching.packing)
        for g in range(samples.size)
    ]
    return np.asarray(rows, dtype=np.float64) / batching.batch_size


def _rows_to_serve_all(
    summaries: ShardSummaries, cuts: np.ndarray, count: np.ndarray, tokens: np.ndarray, batching: Batching
) -> np.ndarray:
    """Per group, rows enough for every token however its documents pack (drop_last=False): the
    plan merges its least full rows (`merge_rows`, concat's cut) until they fit, at worst all of
    them. Why this many suffice, in any document order: give a piece of p tokens the cost
    max(p / seq, c), c = 1 / max_docs_per_row. Every row concat closes costs at least 1 (it holds
    seq tokens, or max_docs_per_row pieces), so its rows are at most 1 + the pieces' cost. The
    pieces cost C = sum over documents of max(w / seq, c) (w: its tokens and extra tokens), plus
    at most c per split (a row boundary cuts one document; a document's interior pieces are whole
    rows, so only its two end pieces can add), at most c * min(rows - 1, 2 * documents). C is
    bounded from the histogram: a bin's lengths at its two ends with the bin's mean (the cost is
    convex in w), its counts the group's share plus the whole of the shards its range cuts (a
    superset of its documents: C only grows with documents)."""
    packing = batching.packing
    seq, maxd, extra = packing.seq_len, packing.max_docs_per_row, packing.extra_tokens
    samples = np.diff(cuts)
    counts, toks = count.astype(np.float64), tokens.astype(np.float64)
    if summaries.num_shards and samples.size:
        offsets = np.concatenate([[0], np.cumsum(summaries.samples)])
        for end in (cuts[:-1], cuts[1:]):  # a range's ends; a shard they cut is counted pro rata
            shard = np.clip(np.searchsorted(offsets, end, side="right") - 1, 0, summaries.num_shards - 1)
            inside = (offsets[shard] < end) & (end < offsets[shard + 1])
            counts = counts + summaries.hist_count[shard] * inside[:, None]
            toks = toks + summaries.hist_tokens[shard] * inside[:, None]
    if packing.policy == "no-split":  # documents longer than a row are left out: they need no rows
        keep = 1.0 - over_a_row(packing)
        counts, toks = counts * keep, toks * keep
    lo, hi = BIN_LOW, BIN_HIGH - 1  # a bin's shortest and longest length
    mean = np.clip(np.divide(toks, counts, out=np.zeros_like(toks), where=counts > 0), lo, hi)
    at_hi = counts * np.divide(mean - lo, hi - lo, out=np.zeros_like(mean), where=hi > lo)
    at_lo = counts - at_hi
    c = 1.0 / maxd

    def cost(w: np.ndarray) -> np.ndarray:
        return np.where(w > 0, np.maximum(w / seq, c), 0.0)  # a document of no tokens has no piece

    docs = np.minimum(counts.sum(axis=1), np.maximum(samples, 0))
    pieces = (at_lo * cost(lo + extra) + at_hi * cost(hi + extra)).sum(axis=1)
    if maxd == 1:
        splits = np.minimum(2 * docs, np.inf)  # every piece its own row: at most 2 extra per document
        rows = 1 + pieces + splits
    else:
        splits = np.minimum(pieces / (1 - c), 2 * docs)  # rows - 1 <= (C + c (rows - 1)): rows - 1 <= C / (1 - c)
        rows = 1 + pieces + c * splits
    return np.where(samples > 0, np.floor(rows), 0.0)


def _capacity(tokens: np.ndarray, samples: np.ndarray, batching: Batching, count: np.ndarray) -> np.ndarray:
    """The most batches each group's range can be split into: one sample each when bucketing; one
    token each when packing (rows are cut at any token, so documents longer than a row never limit
    the count of rows, as they would if counted as samples); no-split cuts rows only between
    documents: one document that fits a row each."""
    if batching.packing is None:
        return samples
    if batching.packing.policy == "no-split":
        fits = np.floor((count * (1.0 - over_a_row(batching.packing))).sum(axis=1)).astype(np.int64)
        return np.minimum(fits, samples)
    return np.floor(tokens.sum(axis=1)).astype(np.int64) + samples * batching.packing.extra_tokens


def shard_namer(source: Any) -> Callable[[int], str] | None:
    """``name_shard`` for `plan_shape`'s errors: a dataset's shard by its path and the dataset's
    URL, and its longest sample where its lengths are at hand (a mixture's sources, or a user's
    several loaders, are told apart); None for sources with neither (tests' arrays)."""
    manifest, url = getattr(source, "manifest", None), getattr(source, "url", None)
    if manifest is None or url is None:
        return None

    def name(shard: int) -> str:
        where = f"shard {manifest.shards[shard].path} of {url}"
        try:
            lengths = source.shard_lengths(shard)
        except Exception:  # noqa: BLE001 - only a name for an error being raised; the shard will do
            lengths = None
        return f"sample {int(np.argmax(lengths))} of {where}" if lengths is not None and len(lengths) else where

    return name


def plan_shape(
    summaries: ShardSummaries,
    data_layout: DataLayout,
    batching: Batching,
    lengths_of: Callable[[int, int], np.ndarray] | None = None,
    name_shard: Callable[[int], str] | None = None,
) -> PlanShape:
    """Ranges, window and batches per DP rank of ``data_layout`` (the same for every epoch).
    ``lengths_of(lo, hi)``, the plan source's lengths of samples [lo, hi), makes one data group's
    in-order count exact; without it that count is estimated as several groups' are.
    ``name_shard(shard)`` says where a shard is, for errors (default: its number)."""
    if batching.max_tokens is not None and summaries.num_shards and int(summaries.longest.max()) > batching.max_tokens:
        shard = int(np.argmax(summaries.longest))
        where = name_shard(shard) if name_shard is not None else f"shard #{shard}"
        raise ValueError(
            f"a sample of length {int(summaries.longest[shard])} ({where}) is longer than "
            f"max_tokens={batching.max_tokens} ({int((summaries.longest > batching.max_tokens).sum())} shard(s) "
            "hold such samples); raise max_tokens or filter these samples out"
        )
    cuts = group_cuts(summaries, data_layout.group_sizes)
    samples = np.diff(cuts)
    count, tokens, squares = group_histograms(summaries, cuts)
    total = int(summaries.samples.sum())
    mean_weight = float(summaries.weight.sum()) / total if total else 1.0
    window = resolve_window(batching, mean_weight)
    if batching.max_tokens is not None and not batching.bucketing:
        batches = _in_order_batches(summaries, cuts, count, tokens, squares, batching, lengths_of)
    else:
        batches = _estimate_batches(count, tokens, squares, samples, batching, window)
        if batching.packing is not None and batching.packing.policy == "no-split":
            batches = batches * fragmentation(summaries, batching, lengths_of)
    if batching.exact and batching.packing is None:
        window = max(int(samples.max(initial=0)), 1)  # one window a group: the fewest batches
    padded = batching.exact  # exact plans pad a group that cannot split down to the count
    stream = _stream_batches(batching, cuts, lengths_of)
    if stream is not None:
        batches = stream
    elif batching.exact and (batching.packing is None or not batching.shuffle):
        batches = _exact_batches(batching, cuts, lengths_of, window)
    elif batching.packing is not None and not batching.drops(data_layout.dp_size):
        # Serving every token: the count must hold the rows that the worst packing can need. No-split
        # merges a group short of rows whole, best-fit decreasing (`merge_rows`): counted exactly.
        if batching.packing.policy == "no-split" and lengths_of is not None:
            batches = whole_document_rows(batching, cuts, lengths_of)
            padded = True  # a group of fewer documents than the count pads its batches with empty rows
        elif batching.packing.policy == "no-split" and batching.exact:
            raise ValueError("an exact plan counts its batches from the lengths: give the plan source's lengths")
        else:
            batches = np.maximum(
                batches, _rows_to_serve_all(summaries, cuts, count, tokens, batching) / batching.batch_size
            )
    elif not batching.drops(data_layout.dp_size):
        least = _one_window_batches(batching, cuts, lengths_of)
        if least is not None:
            batches = np.maximum(batches, least)
    sizes = np.asarray(data_layout.group_sizes, dtype=np.int64)
    max_drop = MAX_DROP if batching.drops(data_layout.dp_size) else 0.0
    # Nothing caps the count of a plan that pads a group which cannot split down to it.
    capacity = np.full(samples.size, 1 << 62, np.int64) if padded else _capacity(tokens, samples, batching, count)
    n = batches_per_rank(batches, tokens.sum(axis=1), capacity, sizes, max_drop) if total else 0
    if n == 0:
        small = int(np.argmin(samples / sizes)) if samples.size else 0
        raise ValueError(
            f"dataset too small for this layout: {total} samples cannot give each of {data_layout.dp_size} "
            f"data-parallel ranks a batch ({data_layout.describe()}); data group {small} holds "
            f"{int(samples[small]) if samples.size else 0} samples for {int(sizes[small])} ranks"
        )
    return PlanShape(data_layout, batching, cuts, window, n, samples, tokens.sum(axis=1), batches)
