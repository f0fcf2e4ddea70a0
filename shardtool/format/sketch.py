"""Weight quantiles inside each shard: where node ranges may cut a shard, with exact prefix sums there.

Node ranges cut the dataset at sample boundaries, a boundary shard shared by two neighbours. From
per-shard totals alone a cut inside a shard can only be placed pro rata, and the tokens on each
side only estimated pro rata. On real text that is badly wrong: one file of /usr/share/doc is 7%
of the corpus, and a small dataset is often a single shard, so group token counts were off by
tens of percent — batch counts chosen from them left 10% of the tokens out, or split batches.

The sketch stores, for every shard, the sample positions where its cumulative weight (the sum of
max(length, 1) the ranges balance) first exceeds j/K of the shard's weight, j = 1..K-1, with the
exact token and weight sums before each. A cut then goes to the nearest such point, and both
sides' token counts are exact. K adapts to the dataset: about 2^18 points in all (6 MB), but at
least 8 a shard and at most 1,024. Up to 256 shards get 1,024 cells each (a single-shard corpus
balances to 0.05% of it), 10^4 shards 16, 10^5 shards 8 (a group holds hundreds of shards there,
so half a cell is noise). O(shards x K) memory, like the rest of the summaries.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["MAX_CELLS", "MIN_CELLS", "ShardSketch", "sketch_cells"]

MIN_CELLS, MAX_CELLS = 8, 1024
TOTAL_POINTS = 1 << 18


def sketch_cells(num_shards: int) -> int:
    """Cells per shard for a dataset of ``num_shards`` shards: a power of two in [8, 1024]."""
    per_shard = TOTAL_POINTS // max(int(num_shards), 1)
    cells = 1 << max(int(per_shard).bit_length() - 1, 0)
    return int(min(max(cells, MIN_CELLS), MAX_CELLS))


@dataclass(frozen=True, eq=False)
class ShardSketch:
    """Interior points j = 1..K-1 of every shard: ``pos`` [S, K-1] (sample index in the shard),
    ``tokens``/``weight`` [S, K-1] (sums of the shard's samples before ``pos``). Int64."""

    cells: int
    pos: np.ndarray
    tokens: np.ndarray
    weight: np.ndarray

    @classmethod
    def from_lengths(cls, lengths: np.ndarray, counts: np.ndarray, cells: int) -> ShardSketch:
        lengths = np.asarray(lengths, dtype=np.int64)
        counts = np.asarray(counts, dtype=np.int64)
        shards = counts.size
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        cum_w = np.concatenate([[0], np.cumsum(np.maximum(lengths, 1))]).astype(np.int64)
        cum_t = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        shard_w = cum_w[offsets[1:]] - cum_w[offsets[:-1]]
        j = np.arange(1, cells, dtype=np.int64)
        # Target j/K of the shard's weight; the point is the number of the shard's samples whose
        # cumulative weight (through them) stays at or below it. Integers only: every machine agrees.
        target = cum_w[offsets[:-1], None] + (shard_w[:, None] * j[None, :]) // cells
        # cum_w[i + 1] is the weight through sample i: count the samples with cum_w[i + 1] <= target.
        through = np.searchsorted(cum_w[1:], target.reshape(-1), side="right").reshape(shards, cells - 1)
        pos = np.clip(through, offsets[:-1, None], offsets[1:, None])
        return cls(
            cells,
            pos - offsets[:-1, None],
            cum_t[pos] - cum_t[offsets[:-1], None],
            cum_w[pos] - cum_w[offsets[:-1], None],
        )

    @classmethod
    def concat(cls, parts: list[ShardSketch]) -> ShardSketch:
        cells = {p.cells for p in parts}
        if len(cells) != 1:
            raise ValueError(f"sketches of different resolutions cannot be joined: {sorted(cells)} cells")
        return cls(cells.pop(), *(np.concatenate([getattr(p, k) for p in parts]) for k in ("pos", "tokens", "weight")))

    def points(self, shard: int, count: int, tokens: int, weight: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(positions, token sums, weight sums) before every point of ``shard``, ends included."""

        def with_ends(inner: np.ndarray, last: int) -> np.ndarray:
            return np.concatenate([[0], inner[shard], [last]]).astype(np.int64)

        return with_ends(self.pos, count), with_ends(self.tokens, tokens), with_ends(self.weight, weight)

    def prefix_tokens(self, shard: int, within: int) -> int | None:
        """Exact tokens of ``shard``'s samples before index ``within`` if that is one of its points
        (a cut the sketch placed), else None."""
        row = self.pos[shard]
        j = int(np.searchsorted(row, within, side="left"))
        return int(self.tokens[shard, j]) if j < row.size and int(row[j]) == within else None
