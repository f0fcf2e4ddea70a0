"""``shardtool plan mix.json``: what a mixture takes from each source over a span of steps."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from ._args import storage_options_from


def plan_mixture(args) -> int:
    import numpy as np

    from ..format import ShardtoolError, open_dataset
    from ..format.manifest import require_packable
    from ..format.sizes import format_size
    from ..plan import Placement
    from ..plan.about import dataset_identity
    from ..plan.mixture import Mixture, MixtureError
    from ..plan.mixture.planner import MixturePlanner, rows_by_step
    from ..plan.mixture.span import check_repeat, span, steps_for_tokens
    from ._layout import data_layout_of, describe_layout
    from ._plan import batching_of, layout_of, node_shards, peak_rss_mb, plan_source, schedule_of, take_mixture_batching

    if args.rank is not None or args.synthetic is not None:
        raise ShardtoolError("--rank and --synthetic plan one dataset; a mixture is planned from its sources' metadata")
    try:
        mixture = Mixture.from_file(args.url)
        take_mixture_batching(args, mixture)
        layout = layout_of(args)
        data, _ = data_layout_of(args, Placement(layout, 0))
        schedule = schedule_of(args)
        batching, rows = rows_by_step(schedule, batching_of(args))
    except ValueError as e:
        raise ShardtoolError(str(e)) from None
    if args.steps is None and args.tokens is None:
        raise ShardtoolError("a mixture has no epoch: give its length with --steps N or --tokens T")
    began = time.perf_counter()
    datasets = {}
    for src in mixture.sources:
        try:
            datasets[src.name] = open_dataset(src.url, storage_options=storage_options_from(args))
        except ShardtoolError as e:
            raise ShardtoolError(f"mixture source {src.name!r}: {e}") from None
        if batching.packing is not None:  # as the loader refuses it
            try:
                require_packable(datasets[src.name].manifest, f"mixture source {src.name!r} ({src.url})")
            except ValueError as e:
                raise ShardtoolError(str(e)) from None

    def planner_for(b) -> MixturePlanner:
        sources = {n: plan_source(d) for n, d in datasets.items()}
        return MixturePlanner(
            mixture,
            sources,
            {n: dataset_identity(d) for n, d in datasets.items()},
            b,
            data,
            rows,
        )

    try:
        planner = planner_for(batching)
        state = planner.start()
        steps = args.steps if args.steps is not None else steps_for_tokens(planner, state, args.tokens)
        if steps < 1:
            raise ValueError(f"--steps must be >= 1, found {steps}")
        spans = span(planner, state, steps)
        seconds = time.perf_counter() - began
        refusal = None
        try:
            check_repeat(planner, state, steps)
        except MixtureError as e:
            refusal = str(e)
    except ValueError as e:
        raise ShardtoolError(str(e)) from None
    sources: dict[str, dict[str, Any]] = {}  # the report's, as JSON
    for s, src in zip(spans, mixture.sources):
        ds = datasets[src.name]
        shard_bytes = np.array([sh.bytes for sh in ds.manifest.shards], dtype=np.int64)
        _, node_bytes = node_shards(ds.summaries, data, layout, shard_bytes)
        shape = planner.planners[src.name].shape(data)
        sources[src.name] = {
            "url": src.url,
            "weight_share": s.weight_share,
            "realized_share": s.realized_share,
            "tokens": s.tokens,
            "tokens_per_epoch": s.tokens_per_epoch,
            "source_epochs": s.epochs,
            "source_epochs_begun": s.epochs_touched,
            "units_per_rank": s.units,
            "units_per_rank_per_epoch": shape.batches_per_rank,
            "bytes_per_node": {
                "min": int(node_bytes.min()),
                "mean": float(node_bytes.mean()),
                "max": int(node_bytes.max()),
            },
        }
    report = {
        "source": args.url,
        "scope": "mixture",
        "steps": steps,
        "max_repeat": mixture.max_repeat,
        "layout": {
            "nodes": layout.num_nodes,
            "ranks_per_node": layout.ranks_per_node,
            "world_size": layout.world_size,
            "dp_size": data.dp_size,
            "data_groups": data.num_groups,
            **describe_layout(args),
        },
        "units": "rows" if batching.packing is not None else "batches",
        "units_per_step": planner.units_per_step,
        "rows_by_step": [list(k) for k in rows] if rows is not None else None,
        # A warmup's steps as served: rows of their length (rows_by_step: rows of the longest, planned).
        "seq_len_by_step": (
            [[first, schedule.size_at(first), schedule.seq_len_at(first)] for first in schedule.firsts]
            if schedule is not None and schedule.seq_lens
            else None
        ),
        "tokens": sum(v["tokens"] for v in sources.values()),
        "schedule": mixture.schedule_identity(),
        "sources": sources,
        "plan_seconds": seconds,
        "peak_rss_mb": peak_rss_mb(),
        "refused": refusal,
    }
    if batching.balance is not None:
        cut = schedule.seq_len_at if schedule is not None and schedule.seq_lens else None
        plain = planner_for(batching.with_balance(None))
        report["compute_balance"] = _balance(planner, plain, data, steps, cut, args.processes)
    if args.json:
        print(json.dumps(report))
    else:
        _print(report, data, format_size)
    if refusal is not None:
        raise ShardtoolError(refusal)
    return 0


BALANCE_STEPS = 2000  # the most steps the report compares, from the first: a run may have millions
REPORT_PASSES = 3.0  # the most samples the report plans, in passes over the sources (`report_steps`)


def _balance(planner, unbalanced, data, steps: int, seq_len_at=None, processes: int = 1) -> dict:
    """Per-step max/mean cost across the DP ranks and the step time lost, over the run's first
    steps (at most ``BALANCE_STEPS``, and as many as `report_steps` allows: each later epoch of a
    source is every group's plan again), with and without balancing (``unbalanced``: the same
    mixture's planner without the cost model); under a warmup, of the rows as cut."""
    from ..plan.cost import step_balance
    from ..plan.mixture.cost import report_steps, step_costs

    batching = planner.batching
    model = batching.balance
    span = range(report_steps(planner, planner.start(), min(steps, BALANCE_STEPS), REPORT_PASSES))
    out: dict[str, Any] = {"cost_model": {"a": model.a, "b": model.b}, "balance_window": batching.balance_window}
    out["micro_batches"], out["steps_compared"] = batching.micro_batches, len(span)
    for name, p in (("unbalanced", unbalanced), ("balanced", planner)):
        costs = step_costs(p, p.start(), range(data.dp_size), span, model, seq_len_at=seq_len_at, processes=processes)
        out[name] = step_balance(costs, batching.micro_batches or 1)
    return out


def _print(report: dict, data, human) -> None:
    from ._plan_report import print_balance

    out = sys.stdout.write
    lay = report["layout"]
    per_step = "one batch of one source" if report["units"] == "batches" else f"{report['units_per_step']} rows"
    if report["seq_len_by_step"]:
        steps = report["seq_len_by_step"]
        later = ", ".join(f"{n} of {s} from step {at:,}" for at, n, s in steps[1:])
        longest = max(s for _, _, s in steps)
        per_step = f"{steps[0][1]} rows of {steps[0][2]} tokens ({later}; cut from rows of {longest})"
    elif report["rows_by_step"]:
        per_step += " (" + ", ".join(f"{n} from step {first:,}" for first, n in report["rows_by_step"][1:]) + ")"
    out(
        f"mixture       {report['source']}: {len(report['sources'])} sources, {report['steps']:,} steps of "
        f"{per_step} per rank, {report['tokens']:,.0f} tokens expected\n"
    )
    out(
        f"layout        {lay['nodes']} nodes x {lay['ranks_per_node']} ranks = {lay['world_size']} ranks; "
        f"{data.describe()}\n"
    )
    if len(report["schedule"]) > 1:
        out(f"schedule      {len(report['schedule'])} entries from steps {[e[0] for e in report['schedule']]}\n")
    out(
        f"\n  {'source':<16}{'target':>8}{'realized':>10}{'tokens':>16}{'epochs':>9}{'units/rank':>12}"
        f"{'bytes/node max':>16}\n"
    )
    for name, s in report["sources"].items():
        out(
            f"  {name:<16}{s['weight_share']:>8.4f}{s['realized_share']:>10.4f}{s['tokens']:>16,.0f}"
            f"{s['source_epochs']:>9.2f}{s['units_per_rank']:>12,}{human(s['bytes_per_node']['max']):>16}\n"
        )
    out(
        f"\n  target: the schedule's share of the tokens; realized: the composition's (expected tokens per "
        f"unit);\n  epochs: passes over the source by the last step (max_repeat {report['max_repeat']})\n"
    )
    if "compute_balance" in report:
        compared = report["compute_balance"]["steps_compared"]
        if compared < report["steps"]:
            out(
                f"compute       over the first {compared:,} of {report['steps']:,} steps (a report prices at most "
                f"{BALANCE_STEPS:,}, planning at most {REPORT_PASSES:g} times the sources' samples):\n"
            )
        else:
            out(f"compute       over the first {compared:,} steps:\n")
        print_balance(report["compute_balance"], out, report.get("layout"))
    out(
        f"planning      {report['plan_seconds']:.2f} s (every source's shape, from its summaries), peak RSS "
        f"{report['peak_rss_mb']:.0f} MB\n"
    )
