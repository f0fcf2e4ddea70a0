"""The deal of a group's batches that evens out each step's compute across DP ranks (issue 33).

A step ends with an all-reduce, so it lasts as long as its costliest batch (`shardtool.plan.cost`).
Every DP rank plans only its own group, so no rank can see another group's batches; what every
rank can derive alike is the step order: from the seed and the epoch, never from lengths.

A group's units (packed rows, or bucketed batches), in their shuffled order, are cut into blocks
of ``window`` steps' worth. Within a block they are sorted by cost, costliest first, and cut into
the block's steps: the costliest units make the block's first step, and so on, so every step's
units are neighbours in cost. Within a step they go to the group's k batches in snake order
(0, 1, .., k-1, k-1, .., 0, ...), which evens the sums when a batch holds several rows. The
block's steps are then served in an order drawn from (seed, epoch, block) alone: the same on
every group, so step t takes, on every group, the units of the same cost rank within its block —
near the same cost quantile, since each group's share is a random sample of the dataset.

What that does to randomness: which units share a batch is no longer random (they are of like
cost), and neither is which units share a step; when in the epoch a unit comes stays uniformly
random within its block. ``window`` is the knob: the whole epoch (the default) balances best;
fewer steps keep each block's mix closer to the shuffled order's, balancing less.
"""

from __future__ import annotations

import numpy as np

from .batching import PLAN_VERSION
from .cost import BALANCE_VERSION

__all__ = ["balanced_order"]


def balanced_order(
    cost: np.ndarray, k: int, n: int, per_batch: int, seed: int, epoch: int, window: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(unit indices in dealt order, units per dealt batch) for the units of ``cost`` (in the
    group's shuffled order) dealt into ``k * n`` batches of at most ``per_batch`` units — local
    rank j's batches j*n .. j*n + n - 1 — each step's batches of like cost (see the module
    docstring). Fewer units than ``k * n * per_batch`` (a group short of rows): the missing ones
    are spread evenly over the steps, at most ``per_batch - 1`` a batch, so none is empty."""
    cost = np.asarray(cost, np.float64)
    units, slots = cost.size, k * n * per_batch
    if not k * n <= units <= slots:
        raise ValueError(f"balanced_order: {units} units for {k} x {n} batches of 1 to {per_batch}")
    window = n if window is None else max(1, min(int(window), n))
    # Real units per step chunk: the shortfall shared out evenly, the cheapest chunks taking the rest.
    short, extra = divmod(slots - units, n)
    per_chunk = np.full(n, k * per_batch - short, np.int64)
    per_chunk[n - extra :] -= 1
    chunk_at = np.concatenate([[0], np.cumsum(per_chunk)])
    slot = np.empty(units, np.int64)  # dealt position of each unit in the k x n x per_batch grid
    for b, s0 in enumerate(range(0, n, window)):
        s1 = min(s0 + window, n)
        a, z = int(chunk_at[s0]), int(chunk_at[s1])
        ranked = a + np.argsort(-cost[a:z], kind="stable")  # costliest first; ties in shuffled order
        steps = s0 + _step_order(seed, epoch, b, s1 - s0)  # the c-th costliest step is served at steps[c]
        sizes = per_chunk[s0:s1]
        chunk = np.repeat(np.arange(s1 - s0), sizes)
        i = np.arange(z - a) - np.repeat(chunk_at[s0:s1] - a, sizes)  # place within its chunk
        rnd, pos = i // k, i % k
        lane = np.where(rnd % 2 == 0, pos, k - 1 - pos)  # snake: 0..k-1, k-1..0, ...
        slot[ranked] = (lane * n + steps[chunk]) * per_batch + rnd
    order = np.argsort(slot, kind="stable")
    return order.astype(np.int64), np.bincount(slot // per_batch, minlength=k * n).astype(np.int64)


def _step_order(seed: int, epoch: int, block: int, steps: int) -> np.ndarray:
    # From (seed, epoch, block) only: every group derives the same order without any lengths.
    rng = np.random.default_rng(np.random.SeedSequence([seed, epoch, block, PLAN_VERSION, 33, BALANCE_VERSION]))
    return rng.permutation(steps).astype(np.int64)
