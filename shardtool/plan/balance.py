"""Equal batch counts on every rank: pick the count, drop surplus, split to fill deficits."""

from __future__ import annotations

import heapq

import numpy as np

__all__ = ["batches_per_rank", "fit_node", "deal_order"]


def batches_per_rank(node_batches: np.ndarray, node_samples: np.ndarray, ranks_per_node: int) -> int:
    """The per-rank batch count n for the whole world (0 if some rank cannot get a batch).

    Start from floor(total / world_size) and raise n until fewer than
    world_size batches would be dropped world-wide: dropping loses samples for
    this epoch, while splitting a deficit node's largest batches loses nothing.
    n is capped so that every node can still split down to G*n non-empty
    batches (a batch needs at least one sample).
    """
    g = ranks_per_node
    world = g * node_batches.size
    feasible = int(node_samples.min()) // g
    # n = 0 would "drop fewer than world_size batches" on a small dataset, yet serve nothing:
    # a rank always gets at least one batch when every node can split down to that.
    low = max(1, int(node_batches.sum()) // world)
    high = max(low, -(-int(node_batches.max()) // g))

    def dropped(n: int) -> int:
        return int(np.maximum(node_batches - g * n, 0).sum())

    # dropped() is non-increasing in n and dropped(high) == 0: binary search
    # for the smallest n that drops fewer than world_size batches.
    while low < high:
        mid = (low + high) // 2
        if dropped(mid) < world:
            high = mid
        else:
            low = mid + 1
    return min(low, feasible)


def fit_node(starts: np.ndarray, target: int, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """Bring a node's batches (boundaries `starts`, last = end) to exactly `target`.

    Returns (batch_starts, batch_stops) into the node's ordered ids. Surplus
    batches are dropped from a window that moves with the epoch, so that even
    without shuffling a different set is left out each epoch. Deficits are
    filled by splitting the batches with most samples into near-equal parts,
    which keeps every part within the original batch's size and token budget.
    """
    begin, end = starts[:-1], starts[1:]
    count = begin.size
    if count > target:
        surplus = count - target
        drop = (epoch * surplus + np.arange(surplus)) % count
        keep = np.ones(count, dtype=bool)
        keep[drop] = False
        return begin[keep], end[keep]
    if count == target:
        return begin, end
    sizes = (end - begin).tolist()
    parts = [1] * count
    # Max-heap on the size of each batch's largest part; ties by position for determinism.
    heap = [(-size, i) for i, size in enumerate(sizes)]
    heapq.heapify(heap)
    for _ in range(target - count):
        neg_part, i = heapq.heappop(heap)
        if -neg_part <= 1:
            raise ValueError(f"cannot split {count} batches into {target}: too few samples")
        parts[i] += 1
        # (-size) // parts == -ceil(size / parts): the new largest part, negated.
        heapq.heappush(heap, ((-sizes[i]) // parts[i], i))
    parts_arr = np.asarray(parts, dtype=np.int64)
    owner = np.repeat(np.arange(count), parts_arr)
    index = np.arange(target) - np.repeat(np.cumsum(parts_arr) - parts_arr, parts_arr)
    size = (end - begin)[owner]
    new_begin = begin[owner] + size * index // parts_arr[owner]
    new_end = begin[owner] + size * (index + 1) // parts_arr[owner]
    return new_begin, new_end


def deal_order(per_rank: int, ranks_per_node: int) -> np.ndarray:
    """Node batch positions in rank-major order: local rank j gets batches j, j+G, j+2G, ..."""
    return np.arange(per_rank * ranks_per_node).reshape(per_rank, ranks_per_node).T.ravel()
