"""Where a plan's batches are, for `loader.trace`: the samples (packed: pieces) of a rank's
planned batches located in their shards, and every batch of an epoch that serves one sample,
followed through the elastic re-deals and skips of the epoch's later segments."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..plan.packing import Rows
from ..plan.state import LoaderState

__all__ = ["hits_of", "located", "pieces_of", "served_at", "units_across", "units_of"]


def units_of(reader: Any, ds: Any, plan: Any, first: int, stop: int) -> list[dict[str, Any]]:
    """The samples (packed: pieces) of ``plan``'s batches ``first .. stop - 1``, located."""
    if plan.rows is not None:
        return pieces_of(reader, ds, plan.rows.slice(int(plan.row_offsets[first]), int(plan.row_offsets[stop])))
    lo, hi = int(plan.offsets[first]), int(plan.offsets[stop])
    samples = _with(located(reader, ds, np.asarray(plan.ids[lo:hi], dtype=np.int64)), length=plan.lengths[lo:hi])
    if plan.pad is not None and plan.rows is None:  # an exact plan's padding: a stand-in sample
        sizes = np.diff(plan.offsets[first : stop + 1])
        for sample, padding in zip(samples, np.repeat(plan.pad[first:stop], sizes).tolist()):
            sample["valid"] = not padding
    return samples


def pieces_of(reader: Any, ds: Any, rows: Rows) -> list[dict[str, Any]]:
    """The pieces of packed ``rows``, located, each with its ``row``, ``offset`` and ``length``."""
    per_row = np.diff(rows.row_offsets)
    return _with(
        located(reader, ds, np.asarray(rows.span_pos, dtype=np.int64)),
        row=np.repeat(np.arange(per_row.size), per_row),
        offset=rows.span_start,
        length=rows.span_len,
    )


def _with(samples: list[dict[str, Any]], **values: np.ndarray) -> list[dict[str, Any]]:
    for name, column in values.items():
        for sample, value in zip(samples, column.tolist()):
            sample[name] = int(value)
    return samples


def units_across(parts) -> list[dict[str, Any]]:
    """`units_of` of several ``(reader, ds, plan, first, stop, tags)`` in order, as one batch:
    packed rows numbered across the parts, each unit also given ``tags`` (its source, ...)."""
    out: list[dict[str, Any]] = []
    rows = 0
    for reader, ds, plan, first, stop, tags in parts:
        got = units_of(reader, ds, plan, first, stop)
        for unit in got:
            unit.update(tags)
            if plan.rows is not None:
                unit["row"] += rows
        if plan.rows is not None:
            rows += int(plan.row_offsets[stop] - plan.row_offsets[first])
        out += got
    return out


def located(reader: Any, ds: Any, ids: np.ndarray) -> list[dict[str, Any]]:
    """Key, shard path, index in the shard and global index of each of ``ids`` (sample indexes
    read once per shard touched)."""
    shard, index = reader.locate(ids)
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


def hits_of(planner: Any, state: LoaderState, sample: int) -> list[tuple[int, int, int, int, dict]]:
    """Every batch of ``state``'s epoch that serves ``sample``: (segment, DP rank in its layout,
    position in the segment, step of the epoch, {row, offset, length} or {length})."""
    segments = state.segments
    layout = segments[0].layout
    shape = planner.shape(layout)
    group = int(np.searchsorted(shape.cuts, sample, side="right")) - 1
    plan = planner.group(layout, group, state.epoch)
    first = layout.first_dp_rank(group)
    n = plan.batches_per_rank
    hits = []  # (batch of the group's plan, the entry's fields besides where and when)
    if plan.rows is not None:
        spans = np.flatnonzero(plan.rows.span_pos == sample)
        row = np.searchsorted(plan.rows.row_offsets, spans, side="right") - 1
        batch = np.searchsorted(plan.row_offsets, row, side="right") - 1
        for k, r, q in zip(spans.tolist(), row.tolist(), batch.tolist()):
            where = {"row": r - int(plan.row_offsets[q]), "offset": int(plan.rows.span_start[k])}
            hits.append((q, {**where, "length": int(plan.rows.span_len[k])}))
    else:
        at = np.flatnonzero(plan.ids == sample)
        length = int(plan.batch_lengths(np.array([sample]))[0]) if at.size else 0
        hits = [(q, {"length": length}) for q in (np.searchsorted(plan.offsets, at, side="right") - 1).tolist()]
    out = []
    for q, fields in hits:
        served = served_at(segments, first + q // n, q % n)
        if served is not None:
            out.append((*served, fields))
    return out


def served_at(segments: list, d: int, b: int) -> tuple[int, int, int, int] | None:
    """Where DP rank ``d``'s batch ``b`` of the first segment is served: (segment, DP rank in its
    layout, position in it, step of the epoch), following the re-deals of the later segments; None
    where a skip or a re-deal's leftover means it never is (the inverse of
    `shardtool.plan.rank.to_first_segment`)."""
    earlier = 0  # steps of the epoch before segment j
    for j, seg in enumerate(segments):
        if any(a <= b < z for a, z in seg.skipped):
            return None
        last = j == len(segments) - 1
        if b < seg.served or last:
            return j, d, b, earlier + b - sum(max(0, min(z, b) - a) for a, z in seg.skipped)
        k = int(np.searchsorted(seg.unserved(), b))  # its place among the batches re-dealt
        position = d * seg.left + k
        nxt = segments[j + 1]
        if position >= nxt.layout.dp_size * nxt.batches:
            return None  # left over by the re-deal: not served this epoch
        d, b = divmod(position, nxt.batches)
        earlier += seg.delivered
    return None
