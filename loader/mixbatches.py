"""Step b of a mixture, read and put together: its units of each source, from that source's reader.

`MixtureBatches` has the interface of `PlanBatches` (``load(b, alloc)``, ``len``, ``describe``),
so the same worker pool loads it and the batch sequence never depends on ``num_workers``. Which
units step b takes is a closed form of b (`shardtool.plan.mixture.planner`): a worker needs nothing but
the step, and plans a source's next epoch itself when the step reaches it.

Bucketed mixtures take one whole batch of one source per step: the batch is that source's, as
a single-dataset loader would give it. Packed mixtures take ``batch_size`` rows per step from
several sources; each source's rows are written straight into their rows of one [3, B, S]
block (no concatenation copy) and the piece boundaries joined into one ``cu_seqlens`` of the
static shape B * max_docs_per_row + 1. Every batch that is a dict also carries ``__source__``
(the source's name; packed: one per row), ``per_source`` ({name: units}; a warmup's: rows) and
``per_source_tokens`` ({name: real tokens}, padding not counted), for every source of the mixture.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..format.errors import add_note
from ..plan.cost import CostModel
from ..plan.mixture.cost import StepCosts
from ..plan.mixture.planner import MixturePlanner, Piece
from ..plan.mixture.state import MixtureState
from ..plan.packing import Packing, Rows
from ..plan.rank import RankPlan
from ..plan.rowsplit import cut_rows
from ..plan.schedule import Schedule
from .collate import KEY, Alloc
from .imagerows import ImageSpec
from .observability.metrics import Meter
from .packed import PackedReader
from .packlayout import BatchLayout
from .reader import BatchReader, describe_ids
from .tokenpieces import TokenSources
from .workers import PlanBatches

__all__ = ["MixtureBatches"]


class MixtureBatches:
    """Steps ``0 .. steps - 1`` of DP rank ``dp_rank`` under ``state``'s phase."""

    pad = None  # a mixture is never exact (`PlanBatches.pad`): no batch is padding

    def __init__(
        self,
        planner: MixturePlanner,
        state: MixtureState,
        dp_rank: int,
        readers: dict[str, BatchReader],
        steps: int,
        *,
        where: str,
        transform: Callable | None = None,
        collate_fn: Callable | None = None,
        pad_id: int = 0,
        packing: Packing | None = None,
        token_fields: tuple[str, ...] = (),
        images: dict[str, ImageSpec | None] | None = None,
        image_transform: Callable[[bytes], Any] | None = None,
        schedule: Schedule | None = None,
        cost_model: CostModel | None = None,
    ):
        self.planner, self.state, self.dp_rank = planner, state, dp_rank
        # Under a cost model: each step's cost, for the metric lines (`shardtool stats`).
        cut = schedule.seq_len_at if schedule is not None and schedule.seq_lens else None
        self.costs = StepCosts(planner, state, dp_rank, cost_model, self.plan, cut) if cost_model is not None else None
        self.schedule = schedule  # a sequence-length warmup's: the step's rows cut to its length
        self.readers, self.steps, self.where = readers, steps, where
        self.transform, self.collate_fn, self.pad_id = transform, collate_fn, pad_id
        self.packing = packing
        self.names = planner.mixture.names
        self.packed = (
            {
                n: PackedReader(
                    r,
                    packing,
                    name="input_ids",
                    pad_id=pad_id,
                    token_fields=token_fields,
                    images=(images or {}).get(n),
                    image_transform=image_transform,
                )
                for n, r in readers.items()
            }
            if packing is not None
            else None
        )
        self._plans: OrderedDict[tuple[str, int], RankPlan] = OrderedDict()

    def __len__(self) -> int:
        return self.steps

    # ------------------------------------------------------------------ plans, per process
    def plan(self, name: str, epoch: int) -> RankPlan:
        """This rank's units of ``name`` in ``epoch``; the current and next epoch of every source kept."""
        key = (name, epoch)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self.planner.rank_plan(self.state, name, epoch, self.dp_rank)
            while len(self._plans) > 2 * len(self.names):
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return plan

    def prepare(self, step: int) -> None:
        """Plan every source's epoch at ``step`` now, so that forked workers inherit the plans."""
        for name, pieces in self.planner.step_pieces(self.state, step):
            for epoch, _, _ in pieces:
                self.plan(name, epoch)
        positions = self.planner.positions(self.state.at(step))
        for name, position in positions.items():
            self.plan(name, position.epoch)

    def inflate(self, step: int) -> None:
        """Each source's compressed local shards that its epochs planned by `prepare` (which the
        loader calls first, for ``step``) read, decompressed into memory before workers fork
        (`BatchReader.inflate`)."""
        for name, reader in self.readers.items():
            ids = [plan.ids for (n, _), plan in self._plans.items() if n == name]
            if ids:
                reader.inflate(np.concatenate(ids))

    def units(self, b: int) -> list[tuple[str, list[Piece]]]:
        return self.planner.step_pieces(self.state, b)

    def ahead_depth(self, prefetch: int) -> int:
        return max((r.ahead_depth(prefetch) for r in self.readers.values()), default=0)

    def reads(self, b: int) -> list[tuple[BatchReader, np.ndarray]]:
        """The samples step ``b`` reads, by source (`loader.readahead`)."""
        return [(self.readers[name], self._ids(name, pieces)) for name, pieces in self.units(b)]

    def _ids(self, name: str, pieces: list[Piece]) -> np.ndarray:
        parts = []
        for epoch, index, count in pieces:
            plan = self.plan(name, epoch)
            if self.packing is not None:
                parts.append(np.unique(self._rows(name, [(epoch, index, count)]).span_pos))
            else:
                parts.append(plan.ids[plan.offsets[index] : plan.offsets[index + count]])
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def _rows(self, name: str, pieces: list[Piece]) -> Rows:
        packing = self.packing
        if packing is None:
            raise RuntimeError("shardtool internal error: rows are a packed mixture's")
        parts = []
        for epoch, index, count in pieces:
            plan = self.plan(name, epoch)
            rows, offsets = plan.rows, plan.row_offsets
            if not (rows is not None and offsets is not None):
                raise RuntimeError("shardtool internal error: a packed mixture plans its sources packed")
            parts.append(rows.slice(int(offsets[index]), int(offsets[index + count])))
        return parts[0] if len(parts) == 1 else Rows.concat(parts, packing.seq_len)

    def describe(self, b: int) -> str:
        """Step b's units and their shards, for an error message."""
        return "; ".join(
            f"source {name!r} epoch {pieces[0][0]} unit {pieces[0][1]}: "
            f"{describe_ids(self.readers[name], self._ids(name, pieces))}"
            for name, pieces in self.units(b)
        )

    def start_meter(self, meter: Meter, workers: int, restart: bool, entered: float | None) -> None:
        """The metrics count each step as it is handed over (`step_stats`): a mixture runs for
        millions of steps, and its per-step plan is a closed form, not a table."""
        meter.start_steps(self.step_stats, workers, restart, entered)

    def step_stats(self, b: int) -> tuple[int, int, int, dict[str, int]]:
        """Step b: samples (packed: document pieces), real tokens, padded tokens, real tokens per source."""
        samples = tokens = padded = 0
        by_source: dict[str, int] = {}
        seq_len = self.schedule.seq_len_at(b) if self.schedule is not None else None
        for name, pieces in self.units(b):
            if self.packing is not None:
                rows = step_rows(self._rows(name, pieces), pieces, seq_len)
                n, t, p = len(rows.span_len), rows.tokens, rows.num_rows * rows.seq_len
            else:
                n = t = p = 0
                for epoch, index, count in pieces:
                    plan = self.plan(name, epoch)
                    lens = plan.lengths[plan.offsets[index] : plan.offsets[index + count]]
                    n, t = n + len(lens), t + int(lens.sum())
                    p += len(lens) * max(int(lens.max(initial=1)), 1)
            samples, tokens, padded = samples + n, tokens + t, padded + p
            by_source[name] = by_source.get(name, 0) + t
        return samples, tokens, padded, by_source

    # ------------------------------------------------------------------ loading
    def load(self, b: int, alloc: Alloc | None = None) -> Any:
        parts = self.units(b)
        try:
            if self.packing is not None:
                return self._packed(parts, alloc or np.empty, b)
            return self._bucketed(parts, alloc)
        except Exception as e:
            add_note(e, f"at mixture step {b} of {self.where}")
            raise

    def _tally(self, counts: dict[str, int], tokens: dict[str, int]) -> dict[str, Any]:
        return {
            "per_source": {n: counts.get(n, 0) for n in self.names},
            "per_source_tokens": {n: tokens.get(n, 0) for n in self.names},
        }

    def _bucketed(self, parts: list[tuple[str, list[Piece]]], alloc: Alloc | None) -> Any:
        ((name, ((epoch, index, _),)),) = parts  # one unit a step: a whole batch of one source
        plan = self.plan(name, epoch)
        where = f"{self.where}, source {name!r} epoch {epoch}"
        batch = PlanBatches(
            self.readers[name],
            plan.ids,
            plan.offsets,
            where=where,
            transform=self.transform,
            collate_fn=self.collate_fn,
            pad_id=self.pad_id,
        ).load(index, alloc)
        if isinstance(batch, dict):
            tokens = int(plan.lengths[plan.offsets[index] : plan.offsets[index + 1]].sum())
            batch["__source__"] = name
            batch.update(self._tally({name: 1}, {name: tokens}))
        return batch

    def _packed(self, parts: list[tuple[str, list[Piece]]], alloc: Alloc, b: int) -> dict[str, Any]:
        # Each unit is one row, or none where a source's plan is short of rows: such a unit is a
        # row of padding in its place, so every source's rows are exactly its units.
        packed = self.packed
        if packed is None:
            raise RuntimeError("shardtool internal error: made with the packing: `load` comes here only then")
        seq_len = self.schedule.seq_len_at(b) if self.schedule is not None else None
        rows = [(name, step_rows(self._rows(name, pieces), pieces, seq_len)) for name, pieces in parts]
        extra = {
            "__source__": [name for name, r in rows for _ in range(r.num_rows)],
            **self._tally({name: r.num_rows for name, r in rows}, {name: r.tokens for name, r in rows}),
        }
        b = sum(r.num_rows for _, r in rows)  # the step's rows (by step where they ramp)
        batch = read_together([(packed[name], r) for name, r in rows], b, alloc)
        if batch is None:  # remote shards, decoded payloads, or sources of other token dtypes
            batch = self._by_part(packed, rows, b, alloc)
        return {**batch, **extra}

    def _by_part(
        self, packed: dict[str, PackedReader], rows: list[tuple[str, Rows]], b: int, alloc: Alloc
    ) -> dict[str, Any]:
        """The batch of ``b`` rows read source by source (``packed``: their readers), each into its
        rows of one block; piece boundaries joined."""
        packing = self.packing
        if packing is None:
            raise RuntimeError("shardtool internal error: ``packed`` is made with it")
        seq, maxd = rows[0][1].seq_len, packing.max_docs_per_row  # a warmup's step: its cut rows' length
        if maxd is None:
            raise RuntimeError("shardtool internal error: Packing.__post_init__ resolves None to its default")
        block = alloc((3, b, seq), np.int64)
        first = 0
        keys: list[Any] = []
        starts, lengths, offsets = [], [], []
        fields: dict[str, list[np.ndarray]] = {}  # per-token fields (a stored labels one is in the block)
        with_images = any(p.images is not None for p in packed.values())
        images: list[Any] = []
        where: dict[str, list[np.ndarray]] = {k: [] for k in ("image_rows", "image_offsets", "image_tokens")}
        where["image_mask"] = []
        longest = 0
        for name, part in rows:
            count = part.num_rows
            out = packed[name].read(part, np.empty, rows_per_batch=count, into=block[:, first : first + count])
            cu = out["cu_seqlens"].numpy()  # its real entries, then count * seq
            real = cu < count * seq
            starts.append(cu[real].astype(np.int64) + first * seq)
            offsets.append(out["doc_offsets"].numpy()[real[:-1]])
            lengths.append(out["lengths"].numpy())
            keys += out[KEY]
            for f in packed[name].token_fields:
                if f in out:
                    fields.setdefault(f, []).append(out[f].numpy())
            if with_images:  # a source without images has none in its rows
                got = out.get("image_mask")
                where["image_mask"].append(got.numpy() if got is not None else np.zeros((count, seq), dtype=bool))
                if got is not None:
                    images += out["images"]
                    where["image_rows"].append(out["image_rows"].numpy() + first)
                    where["image_offsets"].append(out["image_offsets"].numpy())
                    where["image_tokens"].append(out["image_tokens"].numpy())
            longest = max(longest, out["max_seqlen"])
            first += count
        if first != b:  # the composition's invariant
            raise RuntimeError(f"shardtool internal error: mixture step has {first} rows, expected {b}")
        cu = alloc(b * maxd + 1, np.int32)
        flat = np.concatenate(starts)
        cu[: flat.size] = flat
        cu[flat.size :] = b * seq
        row_tokens = alloc(b, np.int64)
        row_tokens[:] = np.concatenate(lengths)
        doc_offsets = alloc(b * maxd, np.int64)
        doc_offsets[:] = -1
        doc_offsets[: flat.size] = np.concatenate(offsets)
        placed = {}
        for f, parts in fields.items():
            placed[f] = alloc((b, seq), np.result_type(*parts))
            np.concatenate(parts, out=placed[f])
        if with_images:
            placed["image_mask"] = alloc((b, seq), np.bool_)
            np.concatenate(where.pop("image_mask"), out=placed["image_mask"])
            for k, parts in where.items():
                placed[k] = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        return {
            **({"images": images} if with_images else {}),
            **{f: torch.from_numpy(v) for f, v in placed.items()},
            KEY: keys,
            "input_ids": torch.from_numpy(block[0]),
            "labels": torch.from_numpy(block[1]),
            "position_ids": torch.from_numpy(block[2]),
            "cu_seqlens": torch.from_numpy(cu),
            "max_seqlen": int(longest),
            "lengths": torch.from_numpy(row_tokens),
            "doc_offsets": torch.from_numpy(doc_offsets),
        }


def step_rows(rows: Rows, pieces: Sequence[Piece], seq_len: int | None) -> Rows:
    """A source's rows of a step: its units' ``rows``, a row of padding for each unit its plan is
    short of; under a warmup (``seq_len`` shorter than the planned rows) each row cut into rows of
    ``seq_len`` (`cut_rows`), padded to as many as the units' rows make, so each source's tokens
    keep their order and their rows."""
    units = sum(c for _, _, c in pieces)
    rows = _padded(rows, units)
    if seq_len is None or seq_len == rows.seq_len:
        return rows
    return _padded(cut_rows(rows, seq_len), units * (rows.seq_len // seq_len))


def _padded(rows: Rows, count: int) -> Rows:
    """``rows`` followed by empty rows, ``count`` rows in all."""
    if rows.num_rows == count:
        return rows
    offsets = np.concatenate([rows.row_offsets, np.full(count - rows.num_rows, rows.row_offsets[-1])])
    return dataclasses.replace(rows, row_offsets=offsets.astype(np.int64))


SOURCE_SHIFT = 40  # read_together's document ids: part i's sample g is (i << 40) + g


def read_together(
    parts: Sequence[tuple[PackedReader, Rows]], rows_per_batch: int, alloc: Alloc = np.empty
) -> dict[str, Any] | None:
    """One packed batch of the rows of several readers (a mixture's sources), part after part:
    one layout, one pass of token copies and one finish, as for the rows of one dataset. Uses the
    first reader's name, pad id and scratch. None when a part's tokens are not raw arrays in its
    mapped shards, or the parts store tokens in different dtypes (then read part by part)."""
    first_reader = parts[0][0]
    if any(reader.token_fields or reader.images is not None for reader, _ in parts):
        return None  # read part by part: each places its fields
    shifted = [
        dataclasses.replace(rows, span_pos=rows.span_pos + (i << SOURCE_SHIFT)) for i, (_, rows) in enumerate(parts)
    ]
    seq_len = parts[0][1].seq_len  # a warmup's step: its cut rows' length
    packing = first_reader.packing if seq_len == first_reader.packing.seq_len else first_reader.packing.cut_to(seq_len)
    lay = BatchLayout(Rows.concat(shifted, seq_len), packing, rows_per_batch)
    # The layout's sorted distinct documents are each part's, part after part (the shift): no
    # np.unique of its own per part.
    cuts = np.searchsorted(lay.docs, np.arange(1, len(parts), dtype=np.int64) << SOURCE_SHIFT).tolist()
    sources = []
    for i, ((reader, _), a, z) in enumerate(zip(parts, [0, *cuts], [*cuts, len(lay.docs)])):
        src = reader.reader.token_sources(lay.docs[a:z] - (i << SOURCE_SHIFT))
        if src is None:
            return None
        sources.append(src)
    if len({src.dtype for src in sources}) != 1:
        return None
    keys: list[Any] = []
    bufs: list[Any] = []
    which: list[np.ndarray] = []
    for src in sources:
        keys += src.keys
        which.append(src.which + len(bufs))
        bufs += src.buffers
    joined = TokenSources(
        keys,
        bufs,
        np.concatenate(which),
        np.concatenate([src.first for src in sources]),
        np.concatenate([src.counts for src in sources]),
        sources[0].dtype,
    )

    def where(doc: int) -> str:
        part, gid = doc >> SOURCE_SHIFT, doc & ((1 << SOURCE_SHIFT) - 1)
        return parts[part][0].reader.where(gid)

    return first_reader.copy_from(lay, joined, alloc, None, where)
