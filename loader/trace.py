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

from dataclasses import replace
from typing import Any

import numpy as np

from ..plan.packing import Rows
from ..plan.rowsplit import cut_rows
from ..plan.state import LoaderState
from .tracelocate import hits_of, pieces_of, units_across

__all__ = ["dump", "find", "sample_of", "trace", "traces"]


def trace(loader: Any, step: int, *, epoch: int | None = None) -> dict[str, Any]:
    """Rank ``loader.rank``'s batch at ``step`` of ``epoch`` (default: the epoch of the batch the
    loader last handed over, else its current one, at its current position's layout segments), as
    the loader serves it. (During an epoch's last batch the loader's `epoch` is already the next.)

    Returns ``{"epoch", "step", "rank", "dp_rank", "samples"}``; each sample a dict with ``key``,
    ``shard`` (its path in the dataset), ``index`` (in the shard), ``sample`` (global index) and
    ``length``; for packed rows one entry per piece, with ``row`` (in the batch), ``offset`` (of
    the piece's first token in its document) and ``length`` (the piece's tokens, an added eos
    counted). Raises ValueError for a step outside the epoch or one served on an earlier layout.

    A loader of a `Mixture`: its step (global batch) of the run, at the phase its state is in
    (weights and sources as loaded; ``epoch`` does not apply), each sample also naming its
    ``source`` and ``source_epoch``; a step of an earlier phase raises ValueError."""
    return traces(loader, step, step + 1, epoch=epoch)[0]


def traces(loader: Any, first: int, stop: int, *, epoch: int | None = None) -> list[dict[str, Any]]:
    """`trace` of steps ``first .. stop - 1``, the rank's plan made once for all of them."""
    planner = getattr(loader, "planner", None)
    if planner is None:
        raise TypeError(f"trace reads the plan of a ShardedLoader, found {type(loader).__name__}")
    for step in (first, stop - 1):
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step must be an int >= 0, found {step!r}")
    if getattr(loader, "mixture", None) is not None:
        return _mixture_steps(loader, int(first), int(stop))
    if epoch is None:  # the batch in hand: an epoch's last one is traced in that epoch, not the next
        epoch = loader.handed_epoch
    state = _epoch_state(loader, epoch)
    earlier, cut = _segment_steps(loader, state, epoch)
    if first < earlier:
        raise ValueError(
            f"step {first} of epoch {state.epoch} was served on an earlier layout ({earlier} steps a rank "
            f"before the resume onto {loader.data_layout.describe()}): trace it with a loader of that layout"
        )
    plan = planner.rank_plan(state, loader.dp_rank)
    if stop - 1 - earlier >= cut.size - 1:
        raise ValueError(
            f"step {stop - 1} is past epoch {state.epoch}'s end: this rank has {earlier + cut.size - 1} steps in it"
        )
    out = []
    clock = loader.step_clock(epoch)
    for step in range(first, stop):
        out.append(
            {
                "epoch": state.epoch,
                "step": int(step),
                "rank": loader.rank,
                "dp_rank": loader.dp_rank,
                "samples": _units_at(loader, state, plan, cut[step - earlier : step - earlier + 2], clock, step),
            }
        )
    return out


def _units_at(loader: Any, state: LoaderState, plan: Any, bounds: np.ndarray, clock: Any, step: int) -> list:
    """The samples (packed: pieces) of the epoch's ``step``, which takes the current segment's
    delivered batches ``bounds[0] .. bounds[1] - 1`` of ``plan`` (a schedule's step joins several;
    positions past any steps skipped); a sequence-length schedule's rows cut, as served; under a
    token-budget ramp each names its ``micro_batch`` in the step's list."""
    at = [state.last.position_of(k) for k in range(int(bounds[0]), int(bounds[1]))]
    seq_len = clock.schedule.seq_len_at(clock.first_step + step) if clock is not None else None
    if seq_len is not None and plan.rows is not None:
        rows = Rows.concat([plan.batch_rows(p) for p in at], plan.rows.seq_len)
        return pieces_of(loader.reader, loader.dataset, cut_rows(rows, seq_len))
    micro = clock is not None and clock.schedule.micro  # a budget ramp's step: which micro-batch
    return units_across(
        (loader.reader, loader.dataset, plan, p, p + 1, {"micro_batch": i} if micro else {}) for i, p in enumerate(at)
    )


def _segment_steps(loader: Any, state: LoaderState, epoch: int | None) -> tuple[int, np.ndarray]:
    """(steps of the epoch before ``state``'s current segment, the segment's steps as cuts of its
    delivered batches: step ``before + j`` takes ``cut[j] .. cut[j + 1] - 1``): one batch a step,
    or a batch-size schedule's (`shardtool.plan.schedule.StepClock`)."""
    clock = loader.step_clock(epoch)
    if clock is None:
        return sum(s.delivered for s in state.segments[:-1]), np.arange(state.last.steps + 1, dtype=np.int64)
    return clock.segment_cut(state)


def _epoch_state(loader: Any, epoch: int | None) -> LoaderState:
    """The state ``epoch`` is answered from: the loader's own, on its layout (its segments, its
    skips), when it is the loader's epoch (or None); else that epoch planned afresh on the layout."""
    here = LoaderState.from_dict(loader.state_dict())
    if epoch is None or epoch == here.epoch:
        return loader.planner.continue_on(here, loader.data_layout)
    return loader.planner.start(int(epoch), loader.fingerprint, loader.data_layout)


def _mixture_steps(loader: Any, first: int, stop: int) -> list[dict[str, Any]]:
    """A mixture's steps ``first .. stop - 1``: each step's units of every source, in source order
    (as the batch puts them), each sample or piece also naming its ``source``; packed rows are
    numbered across the sources. A source-epoch's plan is made once for the span."""
    from ..plan.mixture.state import MixtureState

    planner = loader.planner
    state = planner.resume(MixtureState.from_dict(loader.state_dict()))
    if first < state.phase.from_step:
        raise ValueError(
            f"step {first} ran in an earlier phase of the mixture (this one, its weights and sources as "
            f"loaded, starts at step {state.phase.from_step}): trace it with a loader of that phase"
        )
    if stop - 1 >= loader.steps:
        raise ValueError(f"step {stop - 1} is past the mixture's end: it runs steps=0..{loader.steps - 1}")
    plans: dict[tuple[str, int], Any] = {}
    return [_mixture_step(loader, state, step, plans) for step in range(first, stop)]


def _mixture_step(
    loader: Any, state: Any, step: int, plans: dict[tuple[str, int], Any], dp_rank: int | None = None
) -> dict[str, Any]:
    planner = loader.planner
    dp_rank = loader.dp_rank if dp_rank is None else dp_rank
    schedule = loader.schedule
    seq_len = schedule.seq_len_at(step) if schedule is not None else None
    parts, cut, first_row = [], [], 0
    for name, pieces in planner.step_pieces(state, step):
        row = first_row
        for epoch, index, count in pieces:
            plan = plans.get((name, epoch))
            if plan is None:
                plan = plans[(name, epoch)] = planner.rank_plan(state, name, epoch, dp_rank)
            tags = {"source": name, "source_epoch": epoch}
            if seq_len is None:
                parts.append((loader.readers[name], loader.datasets[name], plan, index, index + count, tags))
                continue
            # A warmup's step: the source's rows cut as `loader.mixbatches.step_rows` reads them.
            rows = cut_rows(
                plan.rows.slice(int(plan.row_offsets[index]), int(plan.row_offsets[index + count])), seq_len
            )
            for unit in pieces_of(loader.readers[name], loader.datasets[name], rows):
                cut.append({**unit, **tags, "row": unit["row"] + row})
            row += rows.num_rows
        if seq_len is not None:  # the source's units' rows, padding included
            first_row += sum(c for _, _, c in pieces) * (loader.batching.packing.seq_len // seq_len)
    samples = units_across(parts) if seq_len is None else cut
    return {"step": step, "rank": loader.rank, "dp_rank": dp_rank, "samples": samples}


def find(loader: Any, sample: int, *, epoch: int | None = None, source: str | None = None) -> list[dict[str, Any]]:
    """Where global sample ``sample`` is served in ``epoch`` (default: the loader's), from its data
    group's plan alone: one entry per batch holding it (packed: per piece), each ``{"dp_rank",
    "step", "row", "offset", "length"}`` (``row``/``offset`` for packed rows). Empty where the epoch
    leaves it out (its remainder). In the loader's current epoch, the run as its state says it went:
    after an elastic resume, a batch re-dealt is found where the later layout serves it (``dp_rank``
    of that layout; ``segment`` says which), a batch served before the resume where it was, a
    batch the re-deal left over or a step skipped (`skip_steps`) nowhere.

    A loader of a `Mixture`: ``sample`` of ``source``, over the run's steps of the phase its state
    is in (``epoch`` does not apply): each entry's ``step`` is the run's global batch, with
    ``source`` and ``source_epoch``; a packed ``row`` is numbered across the step's sources, as the
    batch has them."""
    planner = getattr(loader, "planner", None)
    if planner is None:
        raise TypeError(f"find reads the plan of a ShardedLoader, found {type(loader).__name__}")
    mixture = getattr(loader, "mixture", None) is not None
    if mixture and source not in loader.datasets:
        raise ValueError(
            f"a mixture's sample is named with its source, one of {sorted(loader.datasets)}; found {source!r}"
        )
    n_samples = len(loader.datasets[source] if mixture else loader.dataset)
    if isinstance(sample, bool) or not isinstance(sample, (int, np.integer)) or not 0 <= sample < n_samples:
        raise ValueError(f"sample must be a global index in [0, {n_samples}), found {sample!r}")
    if mixture:
        return _mixture_find(loader, str(source), int(sample))
    state = _epoch_state(loader, epoch)
    if getattr(loader, "schedule", None) is not None:
        return _scheduled_find(loader, state, int(sample), epoch)
    out = []
    for j, dp_rank, _, step, fields in hits_of(planner, state, int(sample)):
        out.append({"dp_rank": dp_rank, "step": step, **fields, **({"segment": j} if len(state.segments) > 1 else {})})
    return sorted(out, key=lambda e: (e["step"], e["dp_rank"], e.get("offset", 0)))


def _scheduled_find(loader: Any, state: LoaderState, sample: int, epoch: int | None) -> list[dict[str, Any]]:
    """`find` under a schedule: each planned batch holding the sample mapped to the step that
    joins it, and the sample's entries read from that step as `trace` gives it (rows numbered
    across the step, cut to its length), on the DP rank that serves it. After an elastic resume,
    a batch served on an earlier layout is read from that layout's plan, as its segment was then
    (the state's segments up to it), and its steps from where the segments before it left off."""
    clock, plans, multi = loader.step_clock(epoch), {}, len(state.segments) > 1
    segments: dict[int, tuple[LoaderState, int, np.ndarray]] = {}  # j: (state up to it, its steps' cut)

    def segment(j: int) -> tuple[LoaderState, int, np.ndarray]:
        if j not in segments:
            upto = state if j == len(state.segments) - 1 else replace(state, segments=state.segments[: j + 1])
            segments[j] = (upto, *clock.segment_cut(upto))
        return segments[j]

    # The steps holding it, each read once (a step joins several planned batches that may hold it).
    steps = set()
    for j, dp_rank, _, delivered, _ in hits_of(loader.planner, state, sample):
        _, earlier, cut = segment(j)
        delivered -= sum(seg.delivered for seg in state.segments[:j])  # its place in segment j
        steps.add((j, dp_rank, earlier + int(np.searchsorted(cut, delivered, side="right")) - 1))
    out = []
    for j, dp_rank, step in sorted(steps):
        upto, earlier, cut = segment(j)
        if (j, dp_rank) not in plans:
            plans[j, dp_rank] = loader.planner.rank_plan(upto, dp_rank)
        units = _units_at(loader, upto, plans[j, dp_rank], cut[step - earlier : step - earlier + 2], clock, step)
        out += _entries_of(units, sample, FOUND, dp_rank=dp_rank, step=step, **({"segment": j} if multi else {}))
    return sorted(out, key=lambda e: (e["step"], e["dp_rank"], e.get("offset", 0)))


FOUND = ("row", "offset", "length")  # what `find` copies of a unit that holds its sample


def _entries_of(
    units: list[dict[str, Any]], sample: int, keys: tuple[str, ...] = FOUND, **where: Any
) -> list[dict[str, Any]]:
    """`find`'s entries of ``sample`` among a step's ``units`` (as `trace` gives them): ``where``
    (its DP rank, step, ...) and the unit's ``keys`` it has."""
    return [{**where, **{k: u[k] for k in keys if k in u}} for u in units if u["sample"] == sample]


def _mixture_find(loader: Any, name: str, sample: int) -> list[dict[str, Any]]:
    """`find` for a mixture: the source-epochs the run reaches, each unit holding the sample
    mapped to the step that takes it (the inverse of `MixturePlanner.step_pieces`)."""
    from ..plan.mixture.state import MixtureState

    planner = loader.planner
    state = planner.resume(MixtureState.from_dict(loader.state_dict()))
    phase = state.phase
    if name not in phase.names:
        return []
    i = phase.names.index(name)
    rec, layout, comp = phase.sources[i], phase.layout, planner.composition(phase)
    units = comp.units
    head, first, per_epoch = planner.cursor(rec, layout)
    total = comp.counts_at(phase.units_taken(loader.steps, units))[i]  # the source's units the run takes in this phase
    if total == 0:
        return []
    last_epoch, _ = planner.locate(rec, layout, total - 1)
    source_planner = planner.planners[name]
    out = []
    for epoch in range(rec.epoch, last_epoch + 1):
        st = rec.position if epoch == rec.epoch else source_planner.start(epoch, rec.version, layout)
        for j, dp_rank, b, _, fields in hits_of(source_planner, st, sample):
            if j != len(st.segments) - 1:
                continue  # served on an earlier layout, before this phase
            if epoch == rec.epoch:
                if b < first:
                    continue  # served before this phase began
                used = b - first
            else:
                used = head + (epoch - rec.epoch - 1) * per_epoch + b
            if used >= total:
                continue  # past the run's end
            # The last run step whose units begin at or before it; none where that step ends
            # before it (a skip passed over it: never served).
            lo, hi = phase.from_step, loader.steps - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if comp.counts_at(phase.units_from(mid, units))[i] <= used else (lo, mid - 1)
            start = phase.units_from(lo, units)
            before, after = comp.counts_at(start), comp.counts_at(start + units.at(lo))
            if not before[i] <= used < after[i]:
                continue  # in steps skipped (skip_steps): never served
            entry = {"dp_rank": dp_rank, "step": lo, "source": name, "source_epoch": epoch, **fields}
            if "row" in fields:  # a unit is a row: numbered after the step's rows of the sources before it
                entry["row"] = sum(a - z for a, z in zip(after[:i], before[:i])) + used - before[i]
            out.append(entry)
    if loader.schedule is not None and loader.schedule.seq_lens:
        out = _cut_entries(loader, state, name, sample, {(e["dp_rank"], e["step"]) for e in out})
    return sorted(out, key=lambda e: (e["step"], e["dp_rank"], e.get("offset", 0)))


def _cut_entries(loader: Any, state: Any, name: str, sample: int, steps: set[tuple[int, int]]) -> list[dict[str, Any]]:
    """Under a warmup, a mixture sample's entries as the steps that serve it cut their rows: read
    from each step's trace on its DP rank."""
    out: list[dict[str, Any]] = []
    plans: dict[int, dict[tuple[str, int], Any]] = {}
    for dp_rank, step in sorted(steps):
        units = _mixture_step(loader, state, step, plans.setdefault(dp_rank, {}), dp_rank)["samples"]
        mine = [u for u in units if u["source"] == name]
        out += _entries_of(mine, sample, ("source_epoch", *FOUND), dp_rank=dp_rank, step=step, source=name)
    return out


def sample_of(
    loader: Any,
    *,
    key: str | None = None,
    shard: str | int | None = None,
    index: int | None = None,
    source: str | None = None,
) -> int:
    """The global index of the sample with ``key`` (a scan of the shards' sample indexes: metadata
    only, one index a shard), or at ``index`` of ``shard`` (its path or number); of the mixture's
    ``source`` for a mixture's loader. ValueError naming what is not there."""
    if getattr(loader, "mixture", None) is not None:
        if source not in loader.datasets:
            raise ValueError(f"a mixture's sample is named with its source, one of {sorted(loader.datasets)}")
        ds = loader.datasets[source]
    else:
        ds = loader.dataset
    paths = [s.path for s in ds.manifest.shards]
    offsets = np.concatenate([[0], np.cumsum(ds.shard_counts)]).astype(np.int64)
    if key is not None:
        try:
            return ds.locate_key(key)
        except KeyError as e:
            raise ValueError(e.args[0]) from None
    if shard is None or index is None:
        raise ValueError("give a key, or a shard and an index in it")
    s = int(shard) if isinstance(shard, int) or str(shard).isdigit() else paths.index(shard) if shard in paths else -1
    if not 0 <= s < len(paths):
        raise ValueError(f"no shard {shard!r} in {ds.url} (shards: {paths[0]} .. {paths[-1]})")
    if not 0 <= int(index) < int(ds.shard_counts[s]):
        raise ValueError(f"shard {paths[s]} has {int(ds.shard_counts[s])} samples, no #{index}")
    return int(offsets[s]) + int(index)


def dump(loader: Any, first: int, stop: int, out_dir: str) -> list[str]:
    """Steps ``first .. stop - 1`` as the loader delivers them, written to ``out_dir``: per step
    ``step-NNNNNNNN.rank-R.npz`` (every array of the batch, by name) and ``.json`` beside it (the
    step's `trace` and the batch's other fields: keys, sources). Reads the samples, as the loader
    does; positions ``loader`` at ``first`` (its state), so pass a loader of its own. Returns the
    paths written."""
    import json
    import os

    import torch

    if not 0 <= first < stop:
        raise ValueError(f"a span of steps A:B needs 0 <= A < B, found {first}:{stop}")
    steps = traces(loader, first, stop)  # checks the span before reading anything
    state = loader.state_dict()
    if getattr(loader, "mixture", None) is not None:
        from ..plan.mixture.state import MixtureState

        loader.load_state_dict(MixtureState.from_dict(state).at(first).to_dict())
    else:
        st = LoaderState.from_dict(state)
        earlier, cut = _segment_steps(loader, st, None)
        loader.load_state_dict(st.with_served(st.last.position_of(int(cut[first - earlier]))).to_dict())
    os.makedirs(out_dir, exist_ok=True)
    written = []
    batches = iter(loader)
    for t, batch in zip(steps, batches):
        stem = os.path.join(out_dir, f"step-{t['step']:08d}.rank-{loader.rank}")
        arrays = {k: v.numpy() for k, v in batch.items() if isinstance(v, torch.Tensor)}
        # numpy's stubs declare savez(file, *args, allow_pickle: bool = ..., **kwds), and mypy matches
        # a **dict splat against allow_pickle as well, though this one holds only the batch's arrays.
        np.savez(stem + ".npz", **arrays)  # type: ignore[arg-type]
        rest = {k: v for k, v in batch.items() if not isinstance(v, torch.Tensor)}
        with open(stem + ".json", "w", encoding="utf-8") as f:
            json.dump({"trace": t, "fields": rest}, f, default=str)
        written += [stem + ".npz", stem + ".json"]
    batches.close()  # the pass left early: its workers stop now
    return written
