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
    cost: np.ndarray,
    k: int,
    n: int,
    per_batch: int,
    seed: int,
    epoch: int,
    window: int | None = None,
    micro: int = 1,
) -> tuple[np.ndarray, np.ndarray]:
    """(unit indices in dealt order, units per dealt batch) for the units of ``cost`` (in the
    group's shuffled order) dealt into ``k * n`` batches of at most ``per_batch`` units — local
    rank j's batches j*n .. j*n + n - 1 — each step's batches of like cost (see the module
    docstring). A step is ``micro`` consecutive batches of every rank (gradient accumulation: the
    rank's total counts; its micro-batches are dealt its units in snake order too); ``window``
    counts steps. Fewer units than ``k * n * per_batch`` (a group short of rows): the missing ones
    are spread over the steps by their batches, at most ``per_batch - 1`` a batch, none empty."""
    cost = np.asarray(cost, np.float64)
    units, slots = cost.size, k * n * per_batch
    if not k * n <= units <= slots:
        raise ValueError(f"balanced_order: {units} units for {k} x {n} batches of 1 to {per_batch}")
    m = max(1, min(int(micro), n))
    steps = -(-n // m)
    batches = np.full(steps, m, np.int64)  # batches of each step (the last may have fewer)
    batches[-1] = n - m * (steps - 1)
    first = np.concatenate([[0], np.cumsum(batches)[:-1]])  # its first batch index
    # Real units of each step: the shortfall shared out in proportion to the step's batches.
    shortfall = np.diff(np.concatenate([[0], ((slots - units) * np.cumsum(batches)) // n]))
    real = k * per_batch * batches - shortfall
    window = steps if window is None else max(1, min(int(window), steps))
    slot = np.empty(units, np.int64)  # dealt position of each unit in the k x n x per_batch grid
    at = 0
    for b, s0 in enumerate(range(0, steps, window)):
        s1 = min(s0 + window, steps)
        size = int(real[s0:s1].sum())
        ranked = at + np.argsort(-cost[at : at + size], kind="stable")  # costliest first; ties in shuffled order
        at += size
        served = s0 + _step_order(seed, epoch, b, s1 - s0)  # the c-th costliest chunk is served as step served[c]
        sizes = real[served]
        chunk = np.repeat(np.arange(s1 - s0), sizes)
        i = np.arange(size) - np.repeat(np.concatenate([[0], np.cumsum(sizes)[:-1]]), sizes)  # place in its chunk
        rnd, pos = i // k, i % k
        lane = np.where(rnd % 2 == 0, pos, k - 1 - pos)  # snake over the ranks: 0..k-1, k-1..0, ...
        bs = batches[served][chunk]
        turn, at_mb = rnd // bs, rnd % bs
        mb = np.where(turn % 2 == 0, at_mb, bs - 1 - at_mb)  # and over the rank's micro-batches
        slot[ranked] = (lane * n + first[served][chunk] + mb) * per_batch + turn
    order = np.argsort(slot, kind="stable")
    return order.astype(np.int64), np.bincount(slot // per_batch, minlength=k * n).astype(np.int64)


def _step_order(seed: int, epoch: int, block: int, steps: int) -> np.ndarray:
    # From (seed, epoch, block) only: every group derives the same order without any lengths.
    rng = np.random.default_rng(np.random.SeedSequence([seed, epoch, block, PLAN_VERSION, 33, BALANCE_VERSION]))
    return rng.permutation(steps).astype(np.int64)
