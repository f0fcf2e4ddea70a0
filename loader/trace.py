"""What a rank's batch at a step holds, from the plan alone (issue 35: loss-spike triage).

The plan is a pure function of the dataset's metadata, the seed, the layout and the loader's
state, so "which samples did rank r see at step N" costs a plan of that rank's share, not a rerun
and not a read of any sample: the batch's global sample ids come from the rank's plan, their shard
and place in it from the shard offsets, their keys from the shards' sample indexes (metadata).
For packed rows, every piece: which document, from which token of it, how many tokens, in which row.

A step counts as ``len(loader)`` does: batches of the epoch from its first, so after an elastic
resume the batches served on the earlier layout come first; those ran on another layout and are
traced with that layout (a loader built with it, at the state saved then).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..plan.state import LoaderState

__all__ = ["trace"]


def trace(loader: Any, step: int, *, epoch: int | None = None) -> dict[str, Any]:
    """Rank ``loader.rank``'s batch at ``step`` of ``epoch`` (default: the loader's current epoch,
    at its current position's layout segments), as the loader serves it.

    Returns ``{"epoch", "step", "rank", "dp_rank", "samples"}``; each sample a dict with ``key``,
    ``shard`` (its path in the dataset), ``index`` (in the shard), ``sample`` (global index) and
    ``length``; for packed rows one entry per piece, with ``row`` (in the batch), ``offset`` (of
    the piece's first token in its document) and ``length`` (the piece's tokens, an added eos
    counted). Raises ValueError for a step outside the epoch or one served on an earlier layout,
    TypeError for a loader of a Mixture (not traced yet)."""
    planner = getattr(loader, "planner", None)
    if planner is None or getattr(loader, "mixture", None) is not None:
        raise TypeError(
            f"trace reads the plan of a ShardedLoader of one dataset (a Mixture's steps are not traced "
            f"yet), found {type(loader).__name__}"
        )
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step must be an int >= 0, found {step!r}")
    here = LoaderState.from_dict(loader.state_dict())
    if epoch is None or epoch == here.epoch:
        state = planner.continue_on(here, loader.data_layout)
    else:
        state = planner.start(int(epoch), loader.fingerprint, loader.data_layout)
    earlier = sum(s.served for s in state.segments[:-1])
    if step < earlier:
        raise ValueError(
            f"step {step} of epoch {state.epoch} was served on an earlier layout ({earlier} batches a rank "
            f"before the resume onto {loader.data_layout.describe()}): trace it with a loader of that layout"
        )
    plan = planner.rank_plan(state, loader.dp_rank)
    b = int(step) - earlier
    if b >= plan.batches_per_rank:
        raise ValueError(
            f"step {step} is past epoch {state.epoch}'s end: this rank has {earlier + plan.batches_per_rank} batches in it"
        )
    if plan.rows is not None:
        rows = plan.batch_rows(b)
        ids = rows.span_pos
        per_row = np.diff(rows.row_offsets)
        extra = {
            "row": np.repeat(np.arange(per_row.size), per_row).tolist(),
            "offset": rows.span_start.tolist(),
            "length": rows.span_len.tolist(),
        }
    else:
        lo, hi = int(plan.offsets[b]), int(plan.offsets[b + 1])
        ids = plan.ids[lo:hi]
        extra = {"length": plan.lengths[lo:hi].tolist()}
    samples = _located(loader, np.asarray(ids, dtype=np.int64))
    for name, values in extra.items():
        for sample, value in zip(samples, values):
            sample[name] = int(value)
    return {"epoch": state.epoch, "step": int(step), "rank": loader.rank, "dp_rank": loader.dp_rank, "samples": samples}


def _located(loader: Any, ids: np.ndarray) -> list[dict[str, Any]]:
    """Key, shard path, index in the shard and global index of each of ``ids`` (sample indexes
    read once per shard touched)."""
    ds = loader.dataset
    shard, index = loader.reader.locate(ids)
    out = []
    keys: dict[int, Any] = {}
    for s, i, gid in zip(shard.tolist(), index.tolist(), ids.tolist()):
        if s not in keys:
            keys[s] = ds.shard_index(s).keys
        key = keys[s][i]
        out.append(
            {
                "key": key.decode() if isinstance(key, bytes) else str(key),
                "shard": ds.manifest.shards[s].path,
                "index": i,
                "sample": gid,
            }
        )
    return out
