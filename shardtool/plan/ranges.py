"""Which samples, and so which shards, each data group reads: node-sticky, token-balanced ranges.

Ranges depend only on the per-shard summaries and the data layout, never on seed, epoch or
batching, so a node's cache stays valid across epochs and the warmer needs no training config.
A dataset whose length is a byte size (images, file trees: `ShardSummaries.by_samples`) is cut
into equal sample counts instead, so that every rank has full batches of ``batch_size``; any
other is cut by weight. They are computed from the O(shards) summaries alone: a cut falls in the shard where the
cumulative weight (sum of max(length, 1)) reaches the group's share, at the point of the shard's
weight sketch nearest that share (`format.sketch`: so the tokens on each side are exact), or, for
a dataset packed before the sketch, at the sample position that weight fraction of the shard gives. Every rank computes every cut without reading any per-sample
length, and a boundary shard is split at a sample boundary between two neighbours.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..format.summaries import ShardSummaries

__all__ = ["group_cuts", "group_shard_pieces", "locate_ids", "sample_locations", "shards_of_groups"]


def group_cuts(summaries: ShardSummaries, group_sizes: Sequence[int]) -> np.ndarray:
    """Cut points: group g reads global sample ids [cuts[g], cuts[g+1]).

    Group g's share of the total weight is group_sizes[g] / sum(group_sizes). Exact integer
    arithmetic (Python ints: the products outgrow int64 at 10^9 samples), so every rank on every
    machine gets the same cuts.
    """
    sizes = [int(k) for k in group_sizes]
    if not sizes or min(sizes) < 1:
        raise ValueError(f"group sizes must be >= 1, found {list(group_sizes)}")
    if summaries.by_samples:
        return _sample_cuts(int(summaries.samples.sum()), sizes)
    counts = summaries.samples.tolist()
    weights = summaries.weight.tolist()
    offsets = np.concatenate([[0], np.cumsum(summaries.samples)]).astype(np.int64)
    cum_w = np.concatenate([[0], np.cumsum(summaries.weight)]).astype(np.int64)
    total, ranks = int(cum_w[-1]), sum(sizes)
    cuts = [0]
    before = 0
    for k in sizes[:-1]:
        before += k
        # target weight = total * before / ranks, compared as total * before vs cum_w * ranks
        target = total * before
        if not counts:
            cuts.append(0)
            continue
        # The last shard starting at or before the target (cum_w[s] * ranks <= target, in integers).
        shard = min(int(np.searchsorted(cum_w, target // ranks, side="right")) - 1, len(counts) - 1)
        inside = target - int(cum_w[shard]) * ranks  # weight into the shard, times `ranks`
        pos = int(offsets[shard])
        if summaries.sketch is not None:
            pos += _nearest_point(summaries, shard, inside, ranks)
        elif weights[shard] > 0:
            span = weights[shard] * ranks
            pos += min((2 * inside * counts[shard] + span) // (2 * span), counts[shard])
        cuts.append(max(pos, cuts[-1]))
    cuts.append(int(offsets[-1]))
    return np.asarray(cuts, dtype=np.int64)


def _sample_cuts(samples: int, sizes: list[int]) -> np.ndarray:
    """Cuts giving group g a share sizes[g] / sum(sizes) of the samples (`ShardSummaries.by_samples`)."""
    ranks, before, cuts = sum(sizes), 0, [0]
    for k in sizes[:-1]:
        before += k
        cuts.append(samples * before // ranks)
    cuts.append(samples)
    return np.asarray(cuts, dtype=np.int64)


def _nearest_point(summaries: ShardSummaries, shard: int, inside: int, ranks: int) -> int:
    """The sketch point of ``shard`` whose weight before it is nearest ``inside / ranks`` (the
    first of equals): where the cut goes, so that both sides' token counts are known exactly."""
    pos, _, weight = summaries.sketch.points(
        shard, int(summaries.samples[shard]), int(summaries.tokens[shard]), int(summaries.weight[shard])
    )
    error = np.abs(weight * ranks - inside)  # int64: weights < 2^63 / ranks on any real dataset
    return int(pos[int(np.argmin(error))])


def group_shard_pieces(summaries: ShardSummaries, cuts: np.ndarray) -> list[list[tuple[int, int, int]]]:
    """Per group, the (shard, start_in_shard, stop_in_shard) pieces it reads, in shard order.

    Empty shards are never listed: there is nothing in them to read or cache.
    """
    offsets = np.concatenate([[0], np.cumsum(summaries.samples)]).astype(np.int64)
    result: list[list[tuple[int, int, int]]] = []
    for lo, hi in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
        pieces: list[tuple[int, int, int]] = []
        if hi > lo:
            first = int(np.searchsorted(offsets, lo, side="right")) - 1
            last = int(np.searchsorted(offsets, hi - 1, side="right")) - 1
            for shard in range(first, last + 1):
                begin, end = int(offsets[shard]), int(offsets[shard + 1])
                if end > begin:
                    pieces.append((shard, max(lo, begin) - begin, min(hi, end) - begin))
        result.append(pieces)
    return result


def shards_of_groups(summaries: ShardSummaries, cuts: np.ndarray, groups: Sequence[int]) -> list[int]:
    """Sorted shard indices the given groups read: what a node hosting them must cache."""
    pieces = group_shard_pieces(summaries, cuts)
    return sorted({shard for g in groups for shard, _, _ in pieces[g]})


def sample_locations(shard_counts, ids) -> tuple[np.ndarray, np.ndarray]:
    """(shard, index_in_shard) arrays for global sample ids."""
    counts = np.asarray(shard_counts, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    ids = np.asarray(ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= offsets[-1]):
        raise ValueError(f"sample ids must be in [0, {int(offsets[-1])})")
    return locate_ids(offsets, ids)


def locate_ids(offsets: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`sample_locations` for int64 ``ids`` given the shard offsets [0, cumsum(counts)...];
    no range check (an id outside [0, offsets[-1]) gets a shard outside the dataset)."""
    shard = np.searchsorted(offsets, ids, side="right") - 1
    return shard, ids - offsets[shard]
