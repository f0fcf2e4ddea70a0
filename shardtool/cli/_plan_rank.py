"""``shardtool plan --rank R``: what one training rank computes at start-up, timed in a fresh process.

Apart from `cmd_plan` because it runs in a spawned interpreter (its peak memory must be a rank's
own, not the report's) and so must be importable by name, with the batching a loader would use.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import TYPE_CHECKING

from ..plan.schedule import with_runs
from ._layout import data_layout_of
from ._plan import batching_of, layout_of, peak_rss_mb, plan_source, schedule_of

if TYPE_CHECKING:
    from ..format.dataset import Dataset


def for_dataset(batching, source):
    """The batching a ShardedLoader would use on ``source``: bucketing resolved from its manifest
    (off where lengths are bytes, see ``default_bucketing``); a synthetic source has token lengths.
    ValueError where the loader would refuse it (packed rows of a dataset with no token field)."""
    import dataclasses

    from ..format.manifest import require_packable
    from ..plan.batching import default_bucketing

    manifest = getattr(source, "manifest", None)
    if manifest is None:
        return batching
    if batching.packing is not None:
        require_packable(manifest, source.url)
    return dataclasses.replace(batching, bucketing=default_bucketing(manifest.length, batching.shuffle))


def rank_job(args, summaries_path: str | None, result) -> None:
    """What training rank ``args.rank`` computes at start-up, timed in this (fresh) process."""
    from ..plan import Placement, Planner
    from ..plan.synthetic import SyntheticSource

    began = time.perf_counter()
    source: SyntheticSource | Dataset
    if summaries_path is not None:
        from ..format.summaries import ShardSummaries

        source = SyntheticSource(args.synthetic, samples_per_shard=args.samples_per_shard, seed=0)
        with open(summaries_path, "rb") as f:
            data = f.read()
        source.use_summaries(
            ShardSummaries.from_bytes(
                data, lengths_hash=None, counts=source.shard_counts, total_tokens=None, source=summaries_path
            )
        )
    else:
        from ..format import open_dataset

        source = open_dataset(args.url)
        source.summaries  # noqa: B018 - read, as a rank does at start-up
    layout = layout_of(args)
    data, dp_rank = data_layout_of(args, Placement(layout, layout.node_of(args.rank), args.rank))
    batching = with_runs(for_dataset(batching_of(args, source), source), schedule_of(args))
    planner = Planner(plan_source(source), batching)
    state = planner.start(args.epoch, "plan", data)
    plan = planner.rank_plan(state, dp_rank)
    seconds = time.perf_counter() - began
    # `shardtool trace --step N`: the same plan, then one step's samples located in their shards
    # (their keys are then one read of each shard index the step touches, not timed here).
    from ..plan.ranges import sample_locations

    step = plan.batches_per_rank // 2
    located = sample_locations(source.shard_counts, plan.batch(step)) if plan.batches_per_rank else None
    trace_seconds = time.perf_counter() - began
    group, _ = data.group_of(dp_rank)
    group_plan = planner.group(data, group, args.epoch)
    tokens = int(group_plan.lengths.sum())
    left = int(group_plan.batch_lengths(group_plan.remainder).sum()) if group_plan.remainder.size else 0
    if group_plan.rows is not None:
        left = group_plan.remainder_tokens  # the rows left out's tokens (packed)
        tokens = group_plan.rows.tokens + left
    result.put(
        {
            "rank": args.rank,
            "dp_rank": dp_rank,
            "group": group,
            "plan_seconds": seconds,
            "trace_step_seconds": trace_seconds,
            "trace_step_samples": int(located[0].size) if located is not None else 0,
            "peak_rss_mb": peak_rss_mb(),
            "batches_per_rank": plan.batches_per_rank,
            "rank_samples": int(plan.ids.size),
            "padding_efficiency": plan.fill_rate if plan.rows is not None else plan.padding_efficiency,
            "group_samples": int(group_plan.lengths.size),
            "remainder_tokens_fraction": left / tokens if tokens else 0.0,
            "remainder_tokens": int(group_plan.remainder_tokens),
            "remainder_pieces": int(group_plan.remainder_pieces),
        }
    )


def evaluate_rank(args, source) -> dict:
    import multiprocessing as mp

    summaries_path = None
    with tempfile.TemporaryDirectory(prefix="shardtool-plan-") as tmp:
        if args.synthetic is not None:
            summaries_path = os.path.join(tmp, "summaries.arrow")
            with open(summaries_path, "wb") as f:
                f.write(source.summaries.to_bytes("synthetic"))
        ctx = mp.get_context("spawn")  # a fresh interpreter: its peak memory is a rank's own
        result = ctx.Queue()
        proc = ctx.Process(target=rank_job, args=(args, summaries_path, result))
        proc.start()
        try:
            out = result.get(timeout=3600)
        finally:
            proc.join(60)
    return out
