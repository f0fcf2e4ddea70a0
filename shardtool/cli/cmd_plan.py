"""``shardtool plan``: what every node and rank of a layout would read, from metadata only."""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING

from ..plan.cost import CostModel
from ..plan.schedule import with_runs
from ._args import add_storage_option_argument, storage_options_from
from ._layout import LAYOUT_HELP, add_layout_arguments, data_layout_of, describe_layout
from ._plan import (
    add_batching_arguments,
    batch_size_of,
    batching_of,
    layout_of,
    max_tokens_of,
    node_shards,
    peak_rss_mb,
    plan_source,
    require_size,
    schedule_of,
    seq_len_of,
)
from ._plan_rank import evaluate_rank, for_dataset
from ._plan_report import print_report, schedule_report, startup_requests

if TYPE_CHECKING:
    from ..format.dataset import Dataset

HELP = "show the loading plan of a layout: batches per rank, padding, remainder, bytes per node, planning cost"
DESCRIPTION = """\
Plan one epoch of a dataset for a layout from its metadata only (no shard is opened): the
per-shard summaries, and per-sample lengths of the ranges planned.

Without --rank it simulates every data group (as no training rank ever does) and prints batches
per rank (equal on every rank), padding efficiency, the remainder (samples no rank serves this
epoch; they rotate across epochs), bytes and shards each node must cache, and the planning time.
With --rank R it evaluates exactly what training rank R computes at start-up — in a fresh
process, reading the summaries and its own group's lengths — and prints its planning time and
peak memory.

Layouts far beyond this machine are fine: --simulate-nodes 1024 --ranks-per-node 8 only plans.
Without a dataset, --synthetic N makes up N lognormal lengths (median 350, the benchmarks'
corpus), shard by shard from per-shard seeds, so N = 1,000,000,000 needs no 8 GB array.

{layout}

A mixture file (JSON, or YAML with PyYAML installed) names datasets and their weights in tokens,
optionally a schedule of weight changes by step and max_repeat (default 10):
  {{"sources": {{"web": {{"url": "s3://bucket/web", "weight": 0.7}},
               "code": {{"url": "/lustre/code", "weight": 0.3}}}},
   "schedule": [{{"from_step": 90000, "weights": {{"web": 0.5, "code": 0.5}}}}], "max_repeat": 10}}
`shardtool plan mix.json --steps N` plans N steps and prints per source its target and realized
token share, tokens, source-epochs (passes over it) and bytes per node; a span that would pass
over a source more than max_repeat times is refused with a table (exit 1). The file may also say
how the run batches it, as the loader's keywords: "seq_len" and "batch_size", each one value or a
schedule by step ({{"0": 4, "2000": 8}}), and "max_tokens"; --seq-len, --batch-size and
--max-tokens then need not be given (given, they must say the same).

examples:
  shardtool plan mix.json --steps 100000 --nodes 4 --ranks-per-node 8 --seq-len 4096 --batch-size 8
  shardtool plan s3://bucket/ds --nodes 4 --ranks-per-node 8 --max-tokens 65536
  shardtool plan ./ds --simulate-nodes 1024 --ranks-per-node 8 --batch-size 32 --json
  shardtool plan --synthetic 1000000000 --simulate-nodes 1024 --ranks-per-node 8 --max-tokens 65536 --rank 4100
""".format(layout=LAYOUT_HELP)


def add_arguments(p) -> None:
    p.add_argument("url", nargs="?", help="dataset root (local path or fsspec URL), or a mixture file")
    add_storage_option_argument(p)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--nodes", type=int, default=None, help="number of nodes (default 1)")
    where.add_argument(
        "--simulate-nodes",
        type=int,
        default=None,
        metavar="N",
        help="same as --nodes; says that the layout is only planned, never run",
    )
    p.add_argument("--ranks-per-node", type=int, default=1, metavar="G", help="ranks (GPUs) per node (default 1)")
    add_layout_arguments(p)
    add_batching_arguments(p)
    p.add_argument(
        "--epoch",
        type=int,
        default=0,
        help="which epoch to plan (default 0); the order and the remainder change every epoch, node ranges never do",
    )
    p.add_argument(
        "--rank",
        type=int,
        default=None,
        metavar="R",
        help="evaluate only what global rank R computes at start-up, in a fresh process",
    )
    p.add_argument(
        "--synthetic",
        type=int,
        default=None,
        metavar="N",
        help="plan N synthetic lognormal lengths instead of a dataset",
    )
    p.add_argument(
        "--samples-per-shard", type=int, default=10_000, metavar="K", help="shard size of --synthetic (default 10,000)"
    )
    p.add_argument(
        "--processes",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="processes for the simulation of every group (a dataset's epoch; a mixture's compute balance) "
        "(default: up to 2)",
    )
    mx = p.add_argument_group("mixtures (URL is a mixture file: .json or .yaml)")
    length = mx.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, default=None, metavar="N", help="steps (global batches) to plan")
    length.add_argument(
        "--tokens",
        type=int,
        default=None,
        metavar="T",
        help="expected tokens to plan (all ranks), converted into steps",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args) -> int:
    import numpy as np

    from ..format import ShardtoolError, open_dataset
    from ..plan import Placement
    from ..plan.mixture import is_mixture_file
    from ..plan.simulate import simulate_epoch
    from ..plan.synthetic import SyntheticSource

    try:
        cost = CostModel.parse(args.cost_model) if args.cost_model is not None else None
    except ValueError as e:
        raise ShardtoolError(f"--cost-model: {e}") from None
    for flag, value in (("--balance-window", args.balance_window), ("--micro-batches", args.micro_batches)):
        if value is not None and cost is None:
            raise ShardtoolError(f"{flag} balances steps by a cost model: give --cost-model too")
    try:
        schedule_of(args)
    except ValueError as e:
        raise ShardtoolError(str(e)) from None
    if args.url is not None and is_mixture_file(args.url):
        from ._mixture import plan_mixture

        return plan_mixture(args)
    if args.steps is not None or args.tokens is not None:
        raise ShardtoolError(
            "--steps and --tokens give the length of a mixture (a mixture file); a dataset is "
            "planned by epochs (--epoch)"
        )
    if args.url is None and args.synthetic is None:
        raise ShardtoolError("give a dataset URL or --synthetic N")
    try:
        require_size(args)
        layout = layout_of(args)
        data, _ = data_layout_of(args, Placement(layout, 0))
        described = describe_layout(args)
        batching = batching_of(args)
        if args.rank is not None:
            layout.check_rank(args.rank)
    except ValueError as e:
        raise ShardtoolError(str(e)) from None
    made = None
    source: SyntheticSource | Dataset
    manifest = None  # a packed dataset's
    if args.synthetic is not None:
        began = time.perf_counter()
        source = SyntheticSource(args.synthetic, samples_per_shard=args.samples_per_shard, processes=args.processes)
        source.summaries  # noqa: B018 - what a packed dataset stores
        made = time.perf_counter() - began
        name = f"synthetic:{args.synthetic}"
        shard_bytes = source.summaries.tokens * 4  # int32 tokens
    else:
        source = open_dataset(args.url, storage_options=storage_options_from(args))
        manifest = source.manifest
        name = args.url
        shard_bytes = np.array([s.bytes for s in manifest.shards], dtype=np.int64)
        try:
            batching = for_dataset(batching_of(args, source), source)
        except ValueError as e:
            raise ShardtoolError(str(e)) from None
    schedule = schedule_of(args)
    batching = with_runs(batching, schedule)
    summaries = source.summaries
    per_node_shards, node_bytes = node_shards(summaries, data, layout, shard_bytes)
    compression = None if manifest is None else manifest.compression
    # The node cache holds compressed shards decompressed (warm --keep-compressed: as stored).
    if manifest is not None and compression:
        plain = np.array([s.raw_bytes or s.bytes for s in manifest.shards], dtype=np.int64)
        node_plain = np.array([int(plain[s].sum()) if s else 0 for s in per_node_shards], dtype=np.int64)
    report = {
        "source": name,
        "layout": {
            "nodes": layout.num_nodes,
            "ranks_per_node": layout.ranks_per_node,
            "world_size": layout.world_size,
            "dp_size": data.dp_size,
            "data_groups": data.num_groups,
            **described,
        },
        "batching": {
            "batch_size": batch_size_of(args),
            "max_tokens": max_tokens_of(args),
            "seed": args.seed,
            "epoch": args.epoch,
            "shuffle": not args.no_shuffle,
            "seq_len": seq_len_of(args),
            "packing": args.packing if seq_len_of(args) else None,
            "eos_id": args.eos_id,
        },
        "samples": int(summaries.samples.sum()),
        "shards": int(summaries.num_shards),
        "synthetic_seconds": made,
        "bytes_per_node": {
            "min": int(node_bytes.min()),
            "mean": float(node_bytes.mean()),
            "max": int(node_bytes.max()),
        },
        "bytes_per_node_max_over_mean": float(node_bytes.max() / node_bytes.mean()) if node_bytes.mean() else 1.0,
        "shards_per_node": {"min": min(map(len, per_node_shards)), "max": max(map(len, per_node_shards))},
        "startup_requests": startup_requests([len(s) for s in per_node_shards], layout.ranks_per_node),
    }
    if compression:
        report["compression"] = compression
        report["plain_bytes_per_node"] = {
            "min": int(node_plain.min()),
            "mean": float(node_plain.mean()),
            "max": int(node_plain.max()),
        }
    if args.json and layout.num_nodes <= 4096:
        per_node = {"shards": [len(s) for s in per_node_shards], "bytes": node_bytes.tolist()}
        if compression:
            per_node["plain_bytes"] = node_plain.tolist()
        report["per_node"] = per_node
    try:
        if args.rank is not None:
            report["scope"] = "rank"
            report.update(evaluate_rank(args, source))
        else:
            began = time.perf_counter()
            planned = plan_source(source)
            cut = _cut_lengths(schedule, args.epoch) if schedule is not None and schedule.seq_lens else None
            costing = dict(processes=args.processes, cost_model=cost, seq_lens_of=cut)
            sim = simulate_epoch(planned, data, batching, args.epoch, **costing)
            unbalanced = None
            if cost is not None:  # what the same plan would cost without balancing
                unbalanced = simulate_epoch(planned, data, batching.with_balance(None), args.epoch, **costing)
            per_rank = sim.samples_per_rank
            report.update(
                {
                    "scope": "every group",
                    "plan_seconds": time.perf_counter() - began,
                    "peak_rss_mb": peak_rss_mb(),
                    "batches_per_rank": sim.shape.batches_per_rank,
                    "samples_per_rank": {"min": int(per_rank.min()), "max": int(per_rank.max())},
                    "padding_efficiency": sim.padding_efficiency,
                    "remainder_samples": sim.remainder_samples,
                    "remainder_tokens_fraction": sim.remainder_tokens_fraction,
                    "remainder_tokens": sim.remainder_tokens,
                }
            )
            if batching.exact:
                report["padding_batches"] = sim.padding_batches
            if schedule is not None:
                report["schedule"] = schedule_report(
                    schedule, args.epoch, sim.shape.batches_per_rank, sim.position_tokens
                )
            if cost is not None and unbalanced is not None:
                report["compute_balance"] = {
                    "cost_model": {"a": cost.a, "b": cost.b},
                    "balance_window": args.balance_window,
                    "micro_batches": args.micro_batches,
                    "unbalanced": _steps_balance(unbalanced, schedule, args, cost),
                    "balanced": _steps_balance(sim, schedule, args, cost),
                }
            if batching.packing is not None:
                report.update(
                    {
                        "fill_rate": sim.fill_rate,
                        "documents_split": sim.split_docs,
                        "documents_dropped": sim.dropped_docs,
                        "remainder_pieces": sim.remainder_pieces,
                        "rows_per_rank": report.pop("samples_per_rank"),
                        "max_docs_per_row": batching.packing.max_docs_per_row,
                    }
                )
                note = sim.piece_cap_note()
                if note is not None:
                    report["piece_cap"] = note
    except ValueError as e:
        raise ShardtoolError(str(e)) from None
    if args.json:
        print(json.dumps(report))
        return 0
    print_report(report, data)
    return 0


def _steps_balance(sim, schedule, args, cost=None):
    """`EpochSim.balance`; under a batch-size schedule, of its steps: the planned batches each
    step joins, added up per rank (`Schedule.cut`). A packed epoch's last step may join fewer
    than its size: the loader pads it with rows, which ``cost`` (the model) counts as it does."""
    if schedule is None:
        return sim.balance(args.micro_batches or 1)
    import numpy as np

    from ..plan.cost import step_balance

    costs = sim.step_costs
    if costs is None or not costs.shape[1]:
        return None
    first = schedule.epoch_first_step(args.epoch, costs.shape[1])
    cut = schedule.cut(first, costs.shape[1])
    steps = np.add.reduceat(costs, cut[:-1], axis=1)
    packing = sim.shape.batching.packing
    if packing is not None and cost is not None:
        joined = np.diff(cut) * schedule.base  # planned rows of each step
        rows = np.array([schedule.units_at(first + j) for j in range(joined.size)], np.int64)
        steps += cost.a * packing.seq_len * np.maximum(rows - joined, 0)
    return step_balance(steps, args.micro_batches or 1)


def _cut_lengths(schedule, epoch: int):
    """Under a sequence-length warmup: given the batches a rank plans in ``epoch``, the length each
    is served cut to (that of the step that joins it, `Schedule.cut`)."""
    import numpy as np

    def seq_lens(batches: int) -> np.ndarray:
        first = schedule.epoch_first_step(epoch, batches)
        cut = schedule.cut(first, batches)
        per_step = np.array([schedule.seq_len_at(first + j) for j in range(cut.size - 1)], np.int64)
        return np.repeat(per_step, np.diff(cut))

    return seq_lens
