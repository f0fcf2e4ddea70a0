"""Which batch is which, and who loads it: in the trainer, or in worker processes.

`PlanBatches.load(b)` is batch ``b`` of this rank's plan, read and collated. With
``num_workers=0`` the trainer loads batches itself; otherwise a `WorkerPool` (loader/pool.py)
loads them in worker processes into reusable shared-memory slots and delivers them in batch
order, so the batch sequence never depends on ``num_workers``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any, Protocol

import numpy as np
import torch

from ..format.errors import FormatError, add_note
from ..plan.rowsplit import cut_rows
from .collate import Alloc
from .observability.metrics import Meter
from .observability.probe import NO_PROBE, NoProbe, Probe
from .pool import WorkerPool
from .readahead import read_ahead
from .reader import BatchReader, describe_ids


class PlanBatches:
    """Batch b: the batch of global sample ids ``ids[offsets[b]:offsets[b+1]]``, read and collated;
    or, packed, the rows ``packed_rows(b)`` read by ``packed`` (a `PackedReader`)."""

    def __init__(
        self,
        reader: BatchReader,
        ids: np.ndarray,
        offsets: np.ndarray,
        *,
        where: str,
        transform: Callable | None = None,
        collate_fn: Callable | None = None,
        pad_id: int = 0,
        lengths: np.ndarray | None = None,
        packed: Any = None,
        packed_rows: Callable | None = None,
        packed_stats: tuple | None = None,
        packed_pass: tuple | None = None,
        costs: np.ndarray | None = None,
        pad: np.ndarray | None = None,
        rows_per_batch: np.ndarray | None = None,
        seq_lens: np.ndarray | None = None,
    ):
        self.reader = reader
        self.ids = ids
        self.offsets = offsets
        self.where = where
        self.transform = transform
        self.collate_fn = collate_fn
        self.pad_id = pad_id
        self.lengths = lengths  # of ``ids``, from the plan (never the dataset's whole lengths array)
        self.costs = costs  # each batch's cost under the loader's cost model (None: none given)
        self.packed, self.packed_rows, self.packed_stats = packed, packed_rows, packed_stats
        self.packed_pass = packed_pass  # (rows, row_offsets) of the whole pass: read_planned lays out chunks
        self.pad = pad  # an exact plan's padding batches (`RankPlan.pad`): each batch then gets ``valid``
        self.rows_per_batch = rows_per_batch  # packed, per batch (a batch-size schedule); else the reader's
        self.seq_lens = seq_lens  # packed, per batch (a sequence-length schedule): its rows cut to that length

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def start_meter(self, meter: Meter, workers: int, restart: bool, entered: float | None) -> None:
        """The metrics count the pass's batches from their per-batch counts (`stats`)."""
        meter.start_pass(*self.stats(), workers, restart, entered)

    def stats(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per batch: samples (packed: document pieces), real tokens, padded tokens."""
        if self.packed_stats is not None:
            return self.packed_stats
        if self.lengths is None:
            raise RuntimeError(
                "shardtool internal error: a pass's batches carry the plan's lengths (packed: its stats)"
            )
        rel = np.asarray(self.offsets, dtype=np.int64) - int(self.offsets[0])
        lens = np.asarray(self.lengths[int(self.offsets[0]) : int(self.offsets[-1])], dtype=np.int64)
        samples = np.diff(rel)
        cum = np.concatenate([[0], np.cumsum(lens)])
        longest = np.zeros(len(samples), dtype=np.int64)
        full = samples > 0
        if full.any():
            longest[full] = np.maximum.reduceat(np.maximum(lens, 1), rel[:-1][full])
        return samples, cum[rel[1:]] - cum[rel[:-1]], samples * longest

    def inflate(self, start: int) -> None:
        """Decompress into memory the compressed local shards batches ``start`` on read
        (`BatchReader.inflate`); the workers forked after it share them."""
        self.reader.inflate(self.ids[int(self.offsets[start]) : int(self.offsets[-1])])

    def valid(self, b: int) -> torch.Tensor:
        """Batch b's ``valid`` mask: one per sample, or (packed) one per row of the batch's
        ``rows_per_batch``; False on padding rows and on every entry of a padding batch."""
        if self.packed is not None:
            # Only an exact pass has padding to mark, and exact plans have no batch-size schedule:
            # their rows are laid out for the whole pass.
            if self.packed_pass is None:
                raise RuntimeError("shardtool internal error: _steps_before needs a batch-size schedule")
            row_offsets = self.packed_pass[1]
            mask = torch.zeros(self.packed.rows_per_batch, dtype=torch.bool)
            mask[: int(row_offsets[b + 1] - row_offsets[b])] = True
            return mask
        size = int(self.offsets[b + 1] - self.offsets[b])
        if self.pad is None:
            raise RuntimeError("shardtool internal error: asked only of an exact pass's batches (`PassRunner._run`)")
        return torch.full((size,), not bool(self.pad[b]), dtype=torch.bool)

    def ahead_depth(self, prefetch: int) -> int:
        return self.reader.ahead_depth(prefetch)

    def reads(self, b: int) -> list[tuple[BatchReader, np.ndarray]]:
        """The samples batch ``b`` reads (`loader.readahead`): its ids, or a packed batch's documents."""
        if self.packed is None:
            return [(self.reader, self.batch_ids(b))]
        if self.packed_pass is not None:
            rows, offsets = self.packed_pass
            return [(self.reader, rows.slice(int(offsets[b]), int(offsets[b + 1])).span_pos)]
        if self.packed_rows is None:
            raise RuntimeError("shardtool internal error: given with packed (`DatasetEpochs`)")
        return [(self.reader, self.packed_rows(b).span_pos)]

    def batch_ids(self, b: int) -> np.ndarray:
        return self.ids[self.offsets[b] : self.offsets[b + 1]]

    def describe(self, b: int) -> str:
        """Batch b's samples and shards, for an error message."""
        return describe_ids(self.reader, self.batch_ids(b))

    def load(self, b: int, alloc: Alloc | None = None) -> Any:
        """Batch b; ``alloc`` (in a worker): where its arrays are born, a shared-memory slot."""
        ids = self.batch_ids(b)
        try:
            if self.packed is not None:
                if self.packed_pass is not None:
                    return self.packed.read_planned(*self.packed_pass, b, alloc)
                size = int(self.rows_per_batch[b]) if self.rows_per_batch is not None else None
                if self.packed_rows is None:
                    raise RuntimeError("shardtool internal error: given with packed (`DatasetEpochs`)")
                rows = self.packed_rows(b)
                if self.seq_lens is not None:
                    rows = cut_rows(rows, int(self.seq_lens[b]))
                return self.packed.read(rows, alloc, rows_per_batch=size)
            if self.transform is None and self.collate_fn is None:
                # Only a worker's output crosses a process boundary: pack bytes there only.
                batch = self.reader.read_batch(ids, pack=alloc is not None, alloc=alloc)
                self._check_lengths(b, ids, batch["lengths"])
                return batch
            samples = self.reader.read_samples(ids)
            transform = self.transform
            if transform is not None:
                samples = [self._transform(transform, s, g) for s, g in zip(samples, ids.tolist())]
            if self.collate_fn is not None:
                return self.collate_fn(samples)
            return self.reader.collate(samples, ids, pad_id=self.pad_id, alloc=alloc)
        except Exception as e:
            add_note(e, f"while loading batch {b} of {self.where}: {describe_ids(self.reader, ids)}")
            raise

    def _check_lengths(self, b: int, ids: np.ndarray, got) -> None:
        """What was read has the lengths the plan bucketed by (the lengths file): a dataset whose
        lengths file and data disagree would break the token budget, so it is an error."""
        if self.lengths is None:
            return
        want = self.lengths[self.offsets[b] : self.offsets[b + 1]]
        got = got.numpy() if hasattr(got, "numpy") else np.asarray(got)
        if not np.array_equal(got, want):
            k = int(np.flatnonzero(got != want)[0])
            raise FormatError(
                f"{self.reader.where(int(ids[k]))}: its data has length {int(got[k])}, the dataset's "
                f"lengths file says {int(want[k])} (the plan was made from it); run shardtool verify"
            )

    def _transform(self, transform: Callable, sample: dict, gid: int) -> Any:
        try:
            return transform(sample)
        except Exception as e:
            add_note(e, f"in transform of sample {sample.get('__key__')!r} ({self.reader.where(gid)})")
            raise


class BatchStream(Protocol):
    """What `make_dataloader` returns: the in-process generator or a `WorkerPool`, each an iterator
    whose ``close`` ends it early (the pool's workers with it)."""

    def __iter__(self) -> BatchStream: ...

    def __next__(self) -> Any: ...

    def close(self) -> None: ...


def make_dataloader(
    dataset: PlanBatches,
    start: int,
    *,
    num_workers: int,
    prefetch_factor: int,
    pin_memory: bool,
    timeout: float,
    worker_init: Callable[[int], None] | None = None,
    probe: Probe | NoProbe = NO_PROBE,
) -> BatchStream:
    """Batches ``start .. len(dataset)-1`` in order (the name predates our own worker pool);
    ``probe``: the workers' metrics (loader/observability/probe.py; `NO_PROBE`: none), which time
    each batch a worker loads. ``dataset``: `PlanBatches`, or anything with its ``load`` and
    ``len`` (a mixture's steps)."""
    pin = bool(pin_memory) and torch.cuda.is_available()
    # The batches this process loads next are read ahead: every num_workers-th, as the pool deals them.
    load = read_ahead(dataset.load, dataset, stride=num_workers, depth=prefetch_factor or 2)
    if num_workers == 0:
        return _in_process(load, start, len(dataset), pin)
    return WorkerPool(
        probe.timed(load, len(dataset)),
        start,
        len(dataset),
        num_workers=num_workers,
        prefetch_factor=prefetch_factor,
        timeout=timeout,
        pin=pin,
        worker_init=worker_init,
    )


def _in_process(load: Callable, start: int, n: int, pin: bool) -> Generator[Any, None, None]:
    for b in range(start, n):
        batch = load(b)
        yield pin_tree(batch) if pin else batch


def pin_tree(obj: Any) -> Any:
    """Every CPU tensor of a batch in page-locked memory (for asynchronous copies to the GPU)."""
    if isinstance(obj, torch.Tensor):
        return obj.pin_memory() if obj.device.type == "cpu" else obj
    if type(obj) is dict:
        return {k: pin_tree(v) for k, v in obj.items()}
    if type(obj) in (list, tuple) and obj and not isinstance(obj[0], str):
        return type(obj)(pin_tree(v) for v in obj)
    return obj
