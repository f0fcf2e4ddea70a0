"""What ``shardtool plan`` and its mixture report (cli/_mixture.py) share: the layout and batching
from the arguments, the shards each node caches, and the peak memory of the planning process."""

from __future__ import annotations

import resource
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the commands import what they use when they run (a fast `shardtool --help`)
    from ..format.dataset import Dataset
    from ..plan.source import PlanSource
    from ..plan.synthetic import SyntheticSource


def peak_rss_mb() -> float:
    """This process's peak resident memory. VmHWM, not rusage: Linux carries ru_maxrss across
    exec, so a freshly spawned child would report its parent's peak."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def add_batching_arguments(p) -> None:
    """The batching options of ``shardtool plan`` and ``shardtool trace``, as ShardedLoader takes
    them: batch size or token budget, packing, seed, shuffle, drop_last and compute balance."""
    from ..plan.cost import PRESETS

    # Not required here: a mixture file may give them (`take_mixture_batching`); `require_size` checks.
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--batch-size",
        type=batch_size_arg,
        metavar="N|STEP:N,...",
        help="samples per batch; or a schedule by training step, 0:4,2000:8 (4 from step 0, 8 from step "
        "2000), as ShardedLoader(batch_size={0: 4, 2000: 8})",
    )
    size.add_argument(
        "--max-tokens",
        type=max_tokens_arg,
        metavar="T|STEP:T,...",
        help="token budget per batch, padding counted; or a ramp by step, 0:16384,2000:65536 (a step is then "
        "budget / smallest micro-batches of the smallest budget), as ShardedLoader(max_tokens={0: 16384, ...})",
    )
    pk = p.add_argument_group("sequence packing (with --batch-size: rows per batch)")
    pk.add_argument(
        "--seq-len",
        type=seq_len_arg,
        default=None,
        metavar="S",
        help="pack documents into rows of S tokens; or a warmup by step, 0:2048,50000:8192 (shorter rows are "
        "cut from the longest rows' plan)",
    )
    pk.add_argument(
        "--packing",
        choices=["best-fit", "concat", "no-split", "stream"],
        default="best-fit",
        help="how documents fill rows (default best-fit; stream: the stored token stream cut into rows, "
        "rows shuffled, as LitData's TokensLoader)",
    )
    pk.add_argument(
        "--eos-id", type=int, default=None, metavar="ID", help="an end-of-sequence token after each document"
    )
    pk.add_argument(
        "--max-docs-per-row",
        type=int,
        default=None,
        metavar="N",
        help="the most pieces of documents in a row, as ShardedLoader(max_docs_per_row=) (default: seq_len / 32, "
        "at least 64 and at most seq_len; documents of a few tokens fill a row's pieces first)",
    )
    p.add_argument("--seed", type=int, default=0, help="shuffle seed, as given to ShardedLoader (default 0)")
    p.add_argument("--no-shuffle", action="store_true", help="without shuffling (dataset order)")
    p.add_argument(
        "--shuffle-block",
        type=int,
        metavar="SAMPLES",
        help="shuffle a block of this many neighbouring samples at a time, the blocks in a random order "
        "(about a shard's samples: a pass reads a shard or two at once; as ShardedLoader(shuffle_block=))",
    )
    p.add_argument(
        "--drop-last",
        choices=["auto", "yes", "no"],
        default="auto",
        help="may equal counts leave out a surplus (<= 0.2%% of tokens, rotating)? auto (default): "
        "yes with several data-parallel ranks, no with one; as ShardedLoader(drop_last=)",
    )
    p.add_argument(
        "--exact",
        action="store_true",
        help="exact evaluation: every sample served once on any number of ranks, ranks short of a batch "
        "serve padding marked not valid; as ShardedLoader(exact=True)",
    )
    p.add_argument(
        "--cost-model",
        default=None,
        metavar="SPEC",
        help="balance each step's compute across the DP ranks by this cost model (the step waits for the "
        "slowest; plan also reports how evenly it falls): a model shape params=7e9,layers=32,hidden=4096, "
        "measured a=...,b=... (cost = a x tokens + b x sum of squared document-piece lengths), or a preset: "
        + ", ".join(sorted(PRESETS)),
    )
    p.add_argument(
        "--balance-window",
        type=int,
        default=None,
        metavar="STEPS",
        help="with --cost-model: balance within blocks of this many steps (default: the whole epoch; "
        "fewer keep each block's mix of documents closer to the plain shuffle)",
    )
    p.add_argument(
        "--micro-batches",
        type=int,
        default=None,
        metavar="M",
        help="with --cost-model: gradient accumulation, a step is M batches of each rank (their total counts)",
    )


def batch_size_arg(text: str):
    return _size_or_schedule("batch_size", text, "a batch size (8) or a schedule (0:4,2000:8)")


def seq_len_arg(text: str):
    return _size_or_schedule("seq_len", text, "a row length (2048) or a schedule (0:2048,50000:8192)")


def max_tokens_arg(text: str):
    """A token budget (65536), or a ramp by step (0:16384,2000:65536), as `budget_schedule` checks it."""
    import argparse

    from ..plan.schedule import budget_schedule, parse_schedule_text

    try:
        parsed = parse_schedule_text(text, "max_tokens")
        return parsed if isinstance(parsed, int) else budget_schedule(dict(parsed.changes))
    except ValueError as e:
        raise argparse.ArgumentTypeError(
            f"{text!r}: a token budget (65536) or a ramp by step (0:16384,2000:65536): {e}"
        ) from None


def _size_or_schedule(name: str, text: str, what: str):
    import argparse

    from ..plan.schedule import parse_schedule_text

    try:
        return parse_schedule_text(text, name)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {what}: {e}") from None


def require_size(args, mixture: bool = False) -> None:
    """One of ``--batch-size`` and ``--max-tokens`` given (or, for a mixture, in its file):
    ValueError saying so otherwise."""
    if getattr(args, "batch_size", None) is None and getattr(args, "max_tokens", None) is None:
        where = " (or batch_size / max_tokens in the mixture file)" if mixture else ""
        raise ValueError(f"give --batch-size (samples, or rows with --seq-len) or --max-tokens{where}")


def take_mixture_batching(args, mixture) -> None:
    """A mixture file's ``batch_size``, ``seq_len`` and ``max_tokens`` into ``args`` where the
    command line gives none; ValueError where both give one and they differ."""
    from ..plan.schedule import Schedule, budget_schedule, parse_schedule

    def given(value):  # a schedule as the loader takes it ({first step: size}), so messages read alike
        return dict(value.changes) if isinstance(value, Schedule) else value

    got = mixture.batching_args(
        batch_size=given(args.batch_size), seq_len=given(args.seq_len), max_tokens=given(args.max_tokens)
    )
    for name in ("batch_size", "seq_len"):
        value = got[name]
        setattr(args, name, parse_schedule(name, value) if isinstance(value, dict) else value)
    budget = got["max_tokens"]
    args.max_tokens = budget_schedule(budget) if isinstance(budget, dict) else budget
    require_size(args, mixture=True)


def schedule_of(args):
    """The schedule ``--batch-size`` and ``--seq-len`` (or ``--max-tokens``) gave (`shardtool.plan.schedule.Schedule`),
    or None; ValueError where a sequence-length schedule cannot cut whole rows."""
    from ..plan.schedule import Schedule, with_seq_lens

    size, seq = getattr(args, "batch_size", None), getattr(args, "seq_len", None)
    budget = getattr(args, "max_tokens", None)
    if isinstance(budget, Schedule):
        return budget if len(budget.changes) > 1 else None
    if isinstance(seq, Schedule) and len(seq.changes) > 1:
        if size is None:
            raise ValueError("a --seq-len schedule needs --batch-size: the rows per step")
        return with_seq_lens(size, seq)
    return size if isinstance(size, Schedule) and len(size.changes) > 1 else None


def batch_size_of(args):
    """``--batch-size`` as an int (a schedule's base size), or None."""
    from ..plan.schedule import Schedule

    schedule = schedule_of(args)
    if schedule is not None and not schedule.micro:
        return schedule.base
    size = getattr(args, "batch_size", None)
    return size.base if isinstance(size, Schedule) else size


def max_tokens_of(args):
    """``--max-tokens`` as an int (a ramp's smallest budget: the batches planned), or None."""
    from ..plan.schedule import Schedule

    budget = getattr(args, "max_tokens", None)
    return budget.base if isinstance(budget, Schedule) else budget


def seq_len_of(args):
    """``--seq-len`` as an int (a schedule's longest length: the rows planned), or None."""
    from ..plan.schedule import Schedule

    seq = getattr(args, "seq_len", None)
    return max(n for _, n in seq.changes) if isinstance(seq, Schedule) else seq


def layout_of(args):
    from ..plan import Layout

    return Layout(args.simulate_nodes or args.nodes or 1, args.ranks_per_node)


def batching_of(args, source=None):
    from ..plan import Batching
    from ..plan.packing import Packing, with_packed_eos

    seq_len = seq_len_of(args)
    packing = (
        Packing(seq_len, args.packing, eos_id=args.eos_id, max_docs_per_row=getattr(args, "max_docs_per_row", None))
        if seq_len is not None
        else None
    )
    manifest = getattr(source, "manifest", None)
    if manifest is not None:  # documents packed with --eos-id end with it already: as the loader plans them
        packing = with_packed_eos(packing, {args.url: manifest.length.get("eos_id")})
    from ..plan.cost import CostModel

    spec = getattr(args, "cost_model", None)
    return Batching(
        batch_size=batch_size_of(args),
        max_tokens=max_tokens_of(args),
        shuffle=not args.no_shuffle,
        seed=args.seed,
        packing=packing,
        drop_last={"auto": None, "yes": True, "no": False}[args.drop_last],
        balance=CostModel.parse(spec) if spec is not None else None,
        balance_window=getattr(args, "balance_window", None) if spec is not None else None,
        micro_batches=getattr(args, "micro_batches", None) if spec is not None else None,
        shuffle_block=getattr(args, "shuffle_block", None),
        exact=bool(getattr(args, "exact", False)),
    )


def plan_source(source: Dataset | SyntheticSource) -> PlanSource:
    """``source`` as the planner takes it: both are `PlanSource`s (``summaries`` and ``lengths_range``)."""
    return source


def node_shards(summaries, data, layout, shard_bytes):
    """(per node: the sorted shards it caches, bytes per node) of one dataset under ``data``."""
    import numpy as np

    from ..plan import group_cuts, group_shard_pieces

    pieces = group_shard_pieces(summaries, group_cuts(summaries, data.group_sizes))
    per_node = [sorted({s for g in data.groups_on_node(k) for s, _, _ in pieces[g]}) for k in range(layout.num_nodes)]
    return per_node, np.array([int(shard_bytes[s].sum()) if s else 0 for s in per_node], dtype=np.int64)
