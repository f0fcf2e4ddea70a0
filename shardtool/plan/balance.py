"""Equal batch counts on every rank: pick the count, drop surplus, split to fill deficits."""

from __future__ import annotations

import heapq

import numpy as np

__all__ = ["MAX_DROP", "batches_per_rank", "fit_group", "deal_order"]


# Equal counts are chosen so that the batches dropped (estimated from the summaries) carry at
# most this share of the epoch's tokens; deficit groups split batches instead, losing nothing.
MAX_DROP = 0.002


def batches_per_rank(
    group_batches: np.ndarray,
    group_tokens: np.ndarray,
    group_capacity: np.ndarray,
    group_sizes: np.ndarray,
    max_drop: float = MAX_DROP,
) -> int:
    """The per-DP-rank batch count n for the whole world (0 if some rank cannot get a batch).

    ``group_batches`` are each group's batch counts (exact, or estimated from the summaries): n
    is the smallest count whose drop — what groups with more than k_g * n batches leave out —
    carries at most ``max_drop`` of the tokens (0: nothing dropped), because dropping loses samples for this epoch while
    splitting a deficit group's largest batches loses nothing. n is capped so that every group
    can still split down to k_g * n non-empty batches: ``group_capacity`` is the most batches a
    group's range can be split into — its samples for bucketed batches (a batch needs a sample),
    its tokens for packed rows (a row can be cut anywhere, and a batch needs one token).
    """
    batches = np.asarray(group_batches, dtype=np.float64)
    tokens = np.asarray(group_tokens, dtype=np.float64)
    sizes = np.asarray(group_sizes, dtype=np.int64)
    feasible = int((np.asarray(group_capacity, dtype=np.int64) // sizes).min())
    per_batch = np.divide(tokens, batches, out=np.zeros_like(tokens), where=batches > 0)
    allowed = max_drop * float(tokens.sum())

    def dropped(n: int) -> float:
        return float((np.maximum(batches - sizes * n, 0) * per_batch).sum())

    low, high = 1, max(1, int(np.ceil((batches / sizes).max(initial=1))))
    # dropped() is non-increasing in n and dropped(high) == 0: the smallest n within the allowance.
    while low < high:
        mid = (low + high) // 2
        if dropped(mid) <= allowed:
            high = mid
        else:
            low = mid + 1
    return min(low, feasible)


def fit_group(starts: np.ndarray, target: int, epoch: int, pad: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Bring a group's batches (boundaries `starts`, last = end) to exactly `target`.

    Returns (batch_starts, batch_stops) into the group's ordered ids. Surplus
    batches are dropped from a window that moves with the epoch, so that even
    without shuffling a different set is left out each epoch. Deficits are
    filled by splitting the batches with most samples into near-equal parts,
    which keeps every part within the original batch's size and token budget.
    With ``pad`` (an exact plan), batches that cannot be split (one sample each)
    leave the rest of the deficit to empty batches, appended: padding.
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
    split = count
    for _ in range(target - count):
        if not heap or -heap[0][0] <= 1:
            if pad:
                break
            raise ValueError(f"cannot split {count} batches into {target}: too few samples")
        neg_part, i = heapq.heappop(heap)
        parts[i] += 1
        split += 1
        # (-size) // parts == -ceil(size / parts): the new largest part, negated.
        heapq.heappush(heap, ((-sizes[i]) // parts[i], i))
    parts_arr = np.asarray(parts, dtype=np.int64)
    owner = np.repeat(np.arange(count), parts_arr)
    index = np.arange(split) - np.repeat(np.cumsum(parts_arr) - parts_arr, parts_arr)
    size = (end - begin)[owner]
    new_begin = begin[owner] + size * index // parts_arr[owner]
    new_end = begin[owner] + size * (index + 1) // parts_arr[owner]
    empty = np.zeros(target - split, dtype=np.int64)
    return np.concatenate([new_begin, empty]), np.concatenate([new_end, empty])


def deal_order(per_rank: int, group_size: int, runs: int | None = None) -> np.ndarray:
    """Group batch positions in rank-major order: local rank j gets batches j, j+k, j+2k, ...;
    with ``runs``, runs of that many neighbours in turn (j's run is batches j*runs .. j*runs +
    runs - 1, then (j + k)*runs ...), and the batches past the last whole runs one by one."""
    k = group_size
    if runs is None or runs <= 1:
        return np.arange(per_rank * k).reshape(per_rank, k).T.ravel()
    whole = per_rank // runs
    head = np.arange(whole * k * runs).reshape(whole, k, runs).transpose(1, 0, 2).reshape(k, whole * runs)
    tail = whole * k * runs + np.arange((per_rank - whole * runs) * k).reshape(-1, k).T
    return np.concatenate([head, tail], axis=1).ravel()
