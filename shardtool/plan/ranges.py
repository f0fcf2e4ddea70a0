"""Which samples, and so which shards, each node owns.

Ownership depends only on the sample lengths and the node count, never on seed,
epoch or batching, so a node's cache stays valid across epochs and the cache
warmer can compute it without any training config.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "as_lengths",
    "as_shard_counts",
    "node_ranges",
    "node_shard_ranges",
    "shards_for_node",
    "sample_locations",
]


def as_lengths(lengths) -> np.ndarray:
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"lengths must be 1-D, found shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"lengths must be integers, found dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and arr.min() < 0:
        bad = int(np.argmin(arr))
        raise ValueError(f"lengths must be >= 0, found {arr[bad]} at sample {bad}")
    return arr


def as_shard_counts(shard_counts, num_samples: int) -> np.ndarray:
    counts = np.asarray(shard_counts)
    if counts.ndim != 1 or (counts.size and not np.issubdtype(counts.dtype, np.integer)):
        raise ValueError(f"shard_counts must be a 1-D integer array, found {counts.dtype} {counts.shape}")
    counts = counts.astype(np.int64, copy=False)
    if counts.size and counts.min() < 0:
        raise ValueError(f"shard_counts must be >= 0, found {counts.min()}")
    if int(counts.sum()) != num_samples:
        raise ValueError(
            f"shard_counts must add up to the number of lengths: found {int(counts.sum())}, "
            f"expected {num_samples}"
        )
    return counts


def _check_num_nodes(num_nodes: int) -> None:
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, (int, np.integer)) or num_nodes < 1:
        raise ValueError(f"num_nodes must be an int >= 1, found {num_nodes!r}")


def node_ranges(lengths, num_nodes: int) -> np.ndarray:
    """Cut points: node k owns global sample ids [cuts[k], cuts[k+1]).

    Each cut is the sample boundary nearest to k/num_nodes of the cumulative
    token count, weighting every sample as max(length, 1) so that runs of empty
    samples are still spread. Each node therefore holds total/num_nodes tokens
    give or take one sample. With fewer samples than nodes some ranges are empty.
    """
    lengths = as_lengths(lengths)
    _check_num_nodes(num_nodes)
    n = int(num_nodes)
    # Integer arithmetic on cum * n vs k * total keeps the cuts exact (and
    # identical on every machine) where float division could round either way.
    bounds = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(np.maximum(lengths, 1), out=bounds[1:])
    total = int(bounds[-1])
    scaled = bounds * n
    targets = np.arange(1, n, dtype=np.int64) * total
    upper = np.searchsorted(scaled, targets, side="left")
    lower = np.maximum(upper - 1, 0)
    upper = np.minimum(upper, lengths.size)
    take_lower = (targets - scaled[lower]) <= (scaled[upper] - targets)
    inner = np.where(take_lower, lower, upper)
    return np.concatenate([[0], inner, [lengths.size]]).astype(np.int64)


def node_shard_ranges(lengths, shard_counts, num_nodes: int) -> list[list[tuple[int, int, int]]]:
    """Per node, the (shard, start_in_shard, stop_in_shard) pieces it reads, in shard order.

    Empty shards are never listed: there is nothing in them to read or cache.
    """
    lengths = as_lengths(lengths)
    counts = as_shard_counts(shard_counts, lengths.size)
    cuts = node_ranges(lengths, num_nodes)
    offsets = np.concatenate([[0], np.cumsum(counts)])
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


def shards_for_node(lengths, shard_counts, node: int, num_nodes: int) -> list[int]:
    """Sorted shard indices node `node` reads: what its cache must hold."""
    _check_num_nodes(num_nodes)
    if isinstance(node, bool) or not isinstance(node, (int, np.integer)) or not 0 <= node < num_nodes:
        raise ValueError(f"node must be in [0, {num_nodes}), found {node!r}")
    return [shard for shard, _, _ in node_shard_ranges(lengths, shard_counts, num_nodes)[int(node)]]


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
