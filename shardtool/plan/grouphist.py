"""Each data group's length histogram, from the per-shard summaries and the group cuts alone."""

from __future__ import annotations

import numpy as np

from ..format.summaries import BINS, ShardSummaries

__all__ = ["group_histograms"]


def group_histograms(summaries: ShardSummaries, cuts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(count, tokens, squares) [G, BINS] of every group's range, partial shards pro rata.

    Sums whole shards per group with reduceat (no cumulative [shards, BINS] copy: at 10^5 shards
    that is the largest array a rank would hold) and adds the cut shards' fractions."""
    hists = (summaries.hist_count, summaries.hist_tokens, summaries.hist_squares)
    groups = len(cuts) - 1
    if summaries.num_shards == 0:
        zero = np.zeros((groups, BINS))
        return zero, zero, zero
    offsets = np.concatenate([[0], np.cumsum(summaries.samples)]).astype(np.int64)
    shard = np.clip(np.searchsorted(offsets, cuts, side="right") - 1, 0, summaries.num_shards - 1)
    frac = np.divide(
        cuts - offsets[shard], summaries.samples[shard], out=np.zeros(len(cuts)), where=summaries.samples[shard] > 0
    )[:, None]
    token_frac = _token_fractions(summaries, cuts, shard, offsets, frac[:, 0])[:, None]
    edges = np.unique(np.concatenate([[0], shard]))  # the shards where a cut falls, and 0
    out = []
    for h, f in zip(hists, (frac, token_frac, token_frac)):
        # Sums of the shards between consecutive edges; up to each cut = all edges before its
        # shard, plus its fraction of that shard.
        running = np.vstack([np.zeros((1, BINS)), np.cumsum(np.add.reduceat(h, edges, axis=0), axis=0)])
        upto = running[np.searchsorted(edges, shard)] + f * h[shard]
        out.append(np.diff(upto, axis=0))
    return out[0], out[1], out[2]


def _token_fractions(
    summaries: ShardSummaries, cuts: np.ndarray, shard: np.ndarray, offsets: np.ndarray, frac: np.ndarray
) -> np.ndarray:
    """Per cut, the share of its shard's tokens before it: exact where the cut is a point of the
    shard's sketch (every cut of a dataset packed with one), else the share of its samples."""
    out = frac.copy()
    if summaries.sketch is None:
        return out
    for i, (cut, s) in enumerate(zip(cuts.tolist(), shard.tolist())):
        within, total = cut - int(offsets[s]), int(summaries.tokens[s])
        if 0 < within < int(summaries.samples[s]) and total > 0:
            exact = summaries.sketch.prefix_tokens(s, within)
            if exact is not None:
                out[i] = exact / total
    return out
