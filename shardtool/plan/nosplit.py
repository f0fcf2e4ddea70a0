"""How many rows ``no-split`` packing needs: more than the tokens say where documents cannot share rows.

No-split never cuts a document, so a row holds whole documents only. Documents just over half a
row (an image's 576 placeholders and its caption, in rows of 1,024) take a row each, and three of
581 tokens fill a row of 2,048 only to 85%. The token count and the length histogram's power-of-two
bins cannot see that: counted from them, one rank of 74 such documents got rows for 44 and left the
rest out. Two counts here fix it, both from the documents' lengths:

- `whole_document_rows`: every group's documents packed best-fit decreasing, as the plan packs a
  group short of rows (`merge_rows`), so a plan that serves every document has the rows it needs;
- `fragmentation`: the rows best-fit decreasing packs a fixed sample of the dataset into, over the
  rows the estimate of a group gives the same sample from its histogram (tokens, and a row for
  each document over half a row; `shardtool.plan.binrows`), so that a plan estimating several
  groups from their histograms (drop_last) leaves out what it should, not a third. The sample is the same on
  every rank (whole shards picked evenly by number), so every rank computes the same count.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..format.summaries import ShardSummaries
from .batching import Batching

__all__ = ["SAMPLE_DOCS", "fragmentation", "whole_document_rows"]

SAMPLE_DOCS = 1 << 16  # documents of the sample `fragmentation` packs (a few ms of best fit)
SAMPLE_SHARDS = 16  # shards the sample is drawn from, evenly by number


def whole_document_rows(
    batching: Batching, cuts: np.ndarray, lengths_of: Callable[[int, int], np.ndarray]
) -> np.ndarray:
    """Per group, batches of the rows its documents take packed best-fit decreasing, those longer
    than a row left out: what a no-split plan short of rows ends with however they come. Reads
    every group's lengths."""
    from .packing.bestfit import best_fit

    packing = batching.packing
    out = np.zeros(cuts.size - 1, dtype=np.float64)
    for g in range(out.size):
        lengths = np.asarray(lengths_of(int(cuts[g]), int(cuts[g + 1])), dtype=np.int64)
        if lengths.size:
            rows = best_fit(lengths + packing.extra_tokens, packing, drop_long=True).num_rows
            out[g] = -(-rows // batching.batch_size)
    return out


def fragmentation(
    summaries: ShardSummaries, batching: Batching, lengths_of: Callable[[int, int], np.ndarray] | None
) -> float:
    """Rows no-split packs a sample of the dataset into over the rows its histogram gives it
    (`shardtool.plan.binrows.histogram_rows`, as for a group; at least 1: the estimate is right where documents share rows well). 1 without lengths."""
    from .binrows import histogram_of, histogram_rows
    from .packing.bestfit import best_fit

    packing = batching.packing
    total = int(summaries.samples.sum())
    if lengths_of is None or packing is None or total == 0:
        return 1.0
    if total <= SAMPLE_DOCS:
        sample = np.asarray(lengths_of(0, total), dtype=np.int64)
    else:
        offsets = np.concatenate([[0], np.cumsum(summaries.samples)])
        picked = np.unique(np.linspace(0, summaries.num_shards - 1, SAMPLE_SHARDS).round().astype(np.int64))
        each = max(1, SAMPLE_DOCS // picked.size)
        sample = np.concatenate(
            [
                np.asarray(lengths_of(int(offsets[s]), int(min(offsets[s + 1], offsets[s] + each))), np.int64)
                for s in picked
            ]
        )
    sizes = sample + packing.extra_tokens
    fits = sizes[(sizes <= packing.seq_len) & (sample > 0)]
    if fits.size == 0:
        return 1.0
    packed = best_fit(fits, packing, drop_long=True).num_rows
    count, tokens = histogram_of(sample)
    estimate = histogram_rows(count, tokens, int(sample.size), 1, packing)
    return max(1.0, packed / estimate) if estimate > 0 else 1.0
