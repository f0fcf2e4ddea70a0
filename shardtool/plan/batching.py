"""Batching config, seeds, and length bucketing of one data group's samples."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace

import numpy as np

from ..format.manifest import length_pads
from .arrays import gather_runs
from .cost import BALANCE_VERSION, CostModel
from .packing import Packing

__all__ = [
    "Batching",
    "PLAN_VERSION",
    "group_rng",
    "resolve_window",
    "bucket",
    "gather_runs",
    "default_bucketing",
    "in_order_starts",
]

# Bumped whenever the planning algorithm changes the batches it produces, so a
# saved position is never replayed against a different plan.
PLAN_VERSION = 2
# Bumped when the count of batches cut in order under a token budget (no bucketing) changes.
IN_ORDER_VERSION = 2

# A window of this many batches' worth of samples sorts enough neighbours
# together to keep padding efficiency above 0.95 on lognormal text lengths,
# while still mixing samples from across about 256 batches.
WINDOW_BATCHES = 256


def default_bucketing(length: dict, shuffle: bool) -> bool:
    """Whether a loader buckets when not told: with shuffling, and only where the dataset's length
    (its manifest's length definition) is a count of what batches pad, not a byte size
    (`shardtool.format.manifest.length_pads`): sorting by bytes only gathers images of like complexity."""
    return bool(shuffle) and length_pads(length)


def _optional_positive(name: str, value) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be None or an int >= 1, found {value!r}")


@dataclass(frozen=True)
class Batching:
    """How a node's samples become batches.

    Exactly one of `batch_size` (samples per batch) and `max_tokens` (a budget
    on batch_size * longest length, i.e. padding counted) is set.

    `window` is the shuffle/bucketing window in samples. Samples are permuted,
    cut into windows, sorted by length within each window and cut into batches.
    Default: 256 batches' worth of samples (256 * batch_size; or
    256 * max_tokens / mean length), which measured >= 0.95 padding efficiency
    on lognormal lengths. In batch_size mode the window is rounded up to a
    multiple of batch_size so that only the group's last window has a short batch.

    `bucketing` sorts by length within windows; it defaults to `shuffle`, so that
    ``shuffle=False`` gives plain dataset order (each data group reads its range in order, its
    ranks take turns batch by batch, like ``DistributedSampler(shuffle=False)``). A loader
    resolves it from the dataset first (:func:`default_bucketing`: off where lengths are bytes).

    `packing` (a `Packing`) packs each window's documents into rows of exactly ``seq_len`` tokens
    instead of bucketing them; ``batch_size`` is then rows per batch and the default window 256
    batches' worth of tokens.

    `drop_last`: whether equal batch counts may leave a little out. ``True``: the count is the
    smallest whose surplus carries at most 0.2% of the tokens (`balance.MAX_DROP`; it rotates
    across epochs), groups short of it split batches. ``False``: nothing is left out — the count
    is the largest group's, every other group splits batches to reach it (exact in ``batch_size``
    mode, for packed rows, for one group cut in order, and for one group's bucketed token budget,
    whose count is at least its batches sorted as one window, and a pass that would need more is
    cut so; several groups' bucketed token budgets are estimated, so a rare surplus can remain).
    Default (None): ``True`` with several DP ranks, ``False`` with one (nothing to equalise).

    `exact` (evaluation): every sample served exactly once on any number of DP ranks, whatever the
    counts. The count is the largest group's exact one (each group's lengths are read: an exact
    plan costs O(dataset), not O(share)); a group short of it splits batches, and where it cannot
    (batches of one sample) it serves *padding batches*, each of one sample of its range marked
    not valid (`RankPlan.pad`; the loader's ``batch["valid"]``). Bucketed batches sort the whole
    group as one window (the fewest batches, so the least padding). Implies ``drop_last=False``.

    `shuffle_block` (samples, with ``shuffle``; bucketed or in-order batches, not packed rows): a
    group's samples are cut in storage order into blocks of this many (rounded up to a multiple of
    ``batch_size``), the blocks read in a random order, samples shuffled, bucketed and batched
    within each block. A pass then reads its shards a block at a time (with blocks about a shard's
    samples, a shard or two at once), as WebDataset's and LitData's shard-wise shuffles do: the
    first batch of a compressed share read in place waits for one shard's decompression, not the
    share's (`loader.inflate`), and reads stay within a shard or two (page cache, fetch on a miss).
    What a batch mixes is one block's samples, not the group's: a weaker shuffle, chosen. (With a
    cost model, the balanced deal orders the steps across the epoch: blocks then decide only
    which samples share a batch, not the order shards are read in.)

    `run_batches` (bucketed batches, with ``shuffle``): the batches of each window, sorted by
    length, are shuffled and dealt to a rank in runs of this many neighbours instead of one by
    one, so that a few consecutive batches of a rank are of like lengths: a batch-size schedule
    (`shardtool.plan.schedule`) joins consecutive batches into one step, which then pads little.
    A rank's batch lengths then fall over each run and jump at the next, as in the megabatches
    of Hugging Face's ``LengthGroupedSampler``.
    """

    batch_size: int | None = None
    max_tokens: int | None = None
    shuffle: bool = True
    seed: int = 0
    window: int | None = None
    bucketing: bool | None = None
    packing: Packing | None = None
    drop_last: bool | None = None
    balance: CostModel | None = None
    balance_window: int | None = None
    micro_batches: int | None = None
    shuffle_block: int | None = None
    exact: bool = False
    run_batches: int | None = None

    def __post_init__(self) -> None:
        if (self.batch_size is None) == (self.max_tokens is None):
            raise ValueError(
                "exactly one of batch_size and max_tokens must be set, found "
                f"batch_size={self.batch_size!r}, max_tokens={self.max_tokens!r}"
            )
        _optional_positive("batch_size", self.batch_size)
        _optional_positive("max_tokens", self.max_tokens)
        _optional_positive("window", self.window)
        if not isinstance(self.shuffle, bool):
            raise ValueError(f"shuffle must be a bool, found {self.shuffle!r}")
        if self.bucketing is None:
            object.__setattr__(self, "bucketing", self.shuffle)
        if not isinstance(self.bucketing, bool):
            raise ValueError(f"bucketing must be a bool or None, found {self.bucketing!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an int >= 0, found {self.seed!r}")
        if self.drop_last is not None and not isinstance(self.drop_last, bool):
            raise ValueError(f"drop_last must be a bool or None, found {self.drop_last!r}")
        if self.balance is not None and not isinstance(self.balance, CostModel):
            raise ValueError(f"balance must be a shardtool.plan.cost.CostModel, found {self.balance!r}")
        _optional_positive("balance_window", self.balance_window)
        _optional_positive("micro_batches", self.micro_batches)
        for name in ("balance_window", "micro_batches"):
            if getattr(self, name) is not None and self.balance is None:
                raise ValueError(f"{name} is a setting of compute balancing: give a cost model too")
        _optional_positive("shuffle_block", self.shuffle_block)
        if self.shuffle_block is not None and not self.shuffle:
            raise ValueError("shuffle_block is a way of shuffling: it needs shuffle=True")
        if self.shuffle_block is not None and self.packing is not None:
            raise ValueError(
                "shuffle_block cuts bucketed batches, not packed rows (for rows read in storage order: packing='stream')"
            )
        _optional_positive("run_batches", self.run_batches)
        if self.run_batches is not None and (self.packing is not None or self.exact or self.balance is not None):
            raise ValueError("run_batches orders bucketed batches: not packed rows, exact plans or balanced deals")
        if not isinstance(self.exact, bool):
            raise ValueError(f"exact must be a bool, found {self.exact!r}")
        if self.exact:
            if self.drop_last:
                raise ValueError("exact serves every sample once: it cannot take drop_last=True")
            for name in ("balance", "shuffle_block"):
                if getattr(self, name) is not None:
                    raise ValueError(f"exact (evaluation) does not take {name}: give one or the other")
            if self.max_tokens is not None and self.shuffle and not self.bucketing:
                raise ValueError(
                    "exact with a token budget cuts batches sorted by length (bucketing) or in dataset "
                    "order (shuffle=False): a shuffled order's count would change every epoch"
                )
        if self.packing is not None:
            if not isinstance(self.packing, Packing):
                raise ValueError(f"packing must be a shardtool.plan.packing.Packing, found {self.packing!r}")
            if self.batch_size is None:
                raise ValueError("packing takes batch_size (rows of seq_len tokens per batch), not max_tokens")

    def with_balance(self, model: CostModel | None, window: int | None = None, micro: int | None = None) -> Batching:
        """This config with steps (of ``micro`` batches a rank) balanced by ``model`` (None: not balanced)."""
        from dataclasses import replace

        on = model is not None
        return replace(self, balance=model, balance_window=window if on else None, micro_batches=micro if on else None)

    def describe(self) -> dict:
        """The settings a person reads in a state-mismatch message: the fields that are set
        (a packing config as its own dict), JSON-ready. The fingerprint stays the identity."""
        fields = {k: v for k, v in asdict(self).items() if v is not None and k != "packing"}
        if not self.exact:
            del fields["exact"]
        if self.packing is not None:
            fields["packing"] = {k: v for k, v in asdict(self.packing).items() if v is not None}
        return fields

    def fingerprint(self) -> str:
        """Stable short hex id of this config and of the planning algorithm version."""
        fields = asdict(self)
        fields["packing"] = self.packing.fingerprint() if self.packing is not None else None
        if self.drop_last is None:
            del fields["drop_last"]  # the default: fingerprints (and saved states) from before it still match
        for name in ("balance", "balance_window", "micro_batches", "shuffle_block", "run_batches"):  # likewise
            if fields[name] is None:
                del fields[name]
        if not self.exact:
            del fields["exact"]
        if self.balance is not None:
            fields["balance_version"] = BALANCE_VERSION
        if self.max_tokens is not None and not self.bucketing:
            # In-order token budgets count their batches anew (issue 32): states from before are
            # refused; every other config keeps its fingerprint (and its shuffle streams).
            fields["in_order_version"] = IN_ORDER_VERSION
        canonical = json.dumps({"plan_version": PLAN_VERSION, **fields}, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def drops(self, dp_size: int) -> bool:
        """Whether equal counts may drop a surplus (`drop_last` resolved for ``dp_size`` DP ranks)."""
        if self.exact:
            return False
        return dp_size > 1 if self.drop_last is None else self.drop_last


def group_rng(batching: Batching, epoch: int, group: int, num_groups: int) -> np.random.Generator:
    # Hashing the arguments (not hash(), not global state) makes every process derive the same
    # stream for the same (seed, epoch, group of so many groups).
    return np.random.default_rng(np.random.SeedSequence([batching.seed, epoch, group, num_groups, PLAN_VERSION]))


def resolve_window(batching: Batching, mean_weight: float) -> int:
    """The window in samples, from the dataset's mean of max(length, 1) (the same for every group)."""
    if batching.packing is not None:
        if batching.window is not None:
            return batching.window
        if batching.batch_size is None:
            raise RuntimeError("shardtool internal error: packing takes batch_size (Batching.__post_init__)")
        tokens = WINDOW_BATCHES * batching.batch_size * batching.packing.seq_len
        return max(1, int(tokens // max(mean_weight, 1.0)))
    if batching.batch_size is not None:
        size = batching.batch_size
        window = batching.window if batching.window is not None else WINDOW_BATCHES * size
        return -(-window // size) * size
    if batching.window is not None:
        return batching.window
    if batching.max_tokens is None:
        raise RuntimeError("shardtool internal error: exactly one of batch_size and max_tokens is set")
    return WINDOW_BATCHES * max(1, int(batching.max_tokens // max(mean_weight, 1.0)))


def bucket(
    ids: np.ndarray,
    lengths: np.ndarray,
    batching: Batching,
    window: int,
    rng: np.random.Generator | None,
) -> tuple[np.ndarray, np.ndarray]:
    """Bucket one group's samples into batches.

    ``lengths[i]`` is the length of ``ids[i]``. Returns (ordered_ids, starts): batch b is
    ordered_ids[starts[b]:starts[b+1]] (starts ends with len(ordered_ids)), batches already in
    their shuffled order. Without an rng nothing is random: windows follow id order, ties by id.
    Without ``batching.bucketing`` batches are cut in that order, with no sorting by length.
    """
    n = ids.size
    if n == 0:
        return ids, np.zeros(1, dtype=np.int64)
    if rng is not None and batching.shuffle_block is not None:
        return _blocks(ids, lengths, batching, window, rng)
    lens = lengths
    if rng is not None:
        perm = rng.permutation(n)
        ids, lens = ids[perm], lens[perm]
    if not batching.bucketing:
        starts = in_order_starts(lens, batching)
        return _shuffle_batches(ids, np.append(starts, n), rng, batching.run_batches)
    positions = np.arange(n, dtype=np.int64)
    if batching.batch_size is not None:
        window_id = positions // window
    else:
        # Equal windows, so the node's last window is not a tiny leftover.
        count = -(-n // window)
        window_id = positions * count // n
    # Longest first inside each window: then a batch opened at sample s is
    # padded to lengths[s] and its size follows from the budget alone.
    order = _window_order(lens, window_id)
    ids, lens = ids[order], lens[order]
    window_starts = np.flatnonzero(np.diff(window_id, prepend=-1))
    window_stops = np.append(window_starts[1:], n)
    if batching.batch_size is not None:
        starts = _fixed_starts(window_starts, window_stops, batching.batch_size)
    else:
        if batching.max_tokens is None:
            raise RuntimeError("shardtool internal error: exactly one of batch_size and max_tokens is set")
        starts = _budget_starts(window_starts, window_stops, lens, batching.max_tokens)
    return _shuffle_batches(ids, np.append(starts, n), rng, batching.run_batches)


def block_samples(batching: Batching) -> int:
    """`Batching.shuffle_block` rounded up to whole batches: every block's batches are full but
    the group's last, so a ``batch_size`` count stays ceil(samples / batch_size)."""
    block = int(batching.shuffle_block or 0)
    size = batching.batch_size
    return -(-block // size) * size if size is not None else block


def _blocks(
    ids: np.ndarray, lengths: np.ndarray, batching: Batching, window: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """`bucket` of each block of ``block_samples`` neighbouring samples, the blocks in a random
    order (drawn first, then each block's own shuffle, in that order, from the one ``rng``)."""
    block = block_samples(batching)
    inner = replace(batching, shuffle_block=None)
    n = ids.size
    cuts = np.append(np.arange(0, n, block, dtype=np.int64), n)
    out_ids, out_starts, at = [], [], 0
    for b in rng.permutation(cuts.size - 1).tolist():
        lo, hi = int(cuts[b]), int(cuts[b + 1])
        got, starts = bucket(ids[lo:hi], lengths[lo:hi], inner, window, rng)
        out_ids.append(got)
        out_starts.append(starts[:-1] + at)
        at += got.size
    return np.concatenate(out_ids), np.append(np.concatenate(out_starts), at).astype(np.int64)


def _window_order(lens: np.ndarray, window_id: np.ndarray) -> np.ndarray:
    """Stable order by (window, longest first): np.lexsort's, by two radix passes where lengths fit
    16 bits (about 4x faster than lexsort on a group of 100k samples)."""
    longest = int(lens.max(initial=0))
    if longest >= 1 << 16 or int(window_id.max(initial=0)) >= 1 << 16:
        return np.lexsort((-lens, window_id))
    by_length = np.argsort((longest - lens).astype(np.uint16), kind="stable")
    return by_length[np.argsort(window_id[by_length].astype(np.uint16), kind="stable")]


def _shuffle_batches(
    ids: np.ndarray, starts: np.ndarray, rng, runs: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Batches in a random order: one by one, or in runs of ``runs`` neighbours kept in order."""
    if rng is None:
        return ids, starts
    sizes = np.diff(starts)
    if runs is None:
        perm = rng.permutation(sizes.size)
    else:
        count = -(-sizes.size // runs)
        first = rng.permutation(count) * runs
        perm = (first[:, None] + np.arange(runs)).ravel()
        perm = perm[perm < sizes.size]
    ids = gather_runs(ids, starts[:-1][perm], sizes[perm])
    return ids, np.concatenate([[0], np.cumsum(sizes[perm])]).astype(np.int64)


def in_order_starts(lens: np.ndarray, batching: Batching) -> np.ndarray:
    """Batch starts over samples in the given order: fixed sizes, or the longest-so-far times the
    count within the budget (padding counted), never reordering."""
    n = lens.size
    if batching.batch_size is not None:
        return np.arange(0, n, batching.batch_size, dtype=np.int64)
    budget = batching.max_tokens
    starts, s, longest = [0], 0, 0
    for i, length in enumerate(np.maximum(lens, 1).tolist()):
        longest_with = max(longest, length)
        if (i - s + 1) * longest_with > budget:
            starts.append(i)
            s, longest = i, length
        else:
            longest = longest_with
    return np.asarray(starts, dtype=np.int64)


def _fixed_starts(window_starts: np.ndarray, window_stops: np.ndarray, size: int) -> np.ndarray:
    counts = -(-(window_stops - window_starts) // size)
    first = np.repeat(window_starts, counts)
    rank_in_window = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    return first + rank_in_window * size


def _budget_starts(window_starts: np.ndarray, window_stops: np.ndarray, lens: np.ndarray, budget: int) -> np.ndarray:
    # A batch opened at s (its longest sample) takes budget // lengths[s]
    # samples; max(.., 1) caps runs of empty samples at `budget` per batch.
    capacity = (budget // np.maximum(lens, 1)).tolist()
    starts: list[int] = []
    for begin, end in zip(window_starts.tolist(), window_stops.tolist()):
        s = begin
        while s < end:
            starts.append(s)
            s += capacity[s]
        # The loop may overshoot the window end; the next window starts fresh.
    return np.asarray(starts, dtype=np.int64)
