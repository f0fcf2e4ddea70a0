"""Parallel reading: a map-style dataset whose item ``b`` is batch ``b`` of this rank's plan.

A `DataLoader` over it with ``batch_size=None`` and a sampler over ``range(start, n)`` gives
real worker processes, ``prefetch_factor`` batches in flight per worker, pinned memory, and
in-order delivery whatever worker finishes first; so the batch sequence never depends on
``num_workers``. Its ``timeout`` and worker-death detection turn a hung or killed worker into
an exception in the trainer instead of a hang.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from .collate import collate_samples
from .reader import BatchReader, describe_ids


class PlanBatches(Dataset):
    """Item b: the batch of global sample ids ``ids[offsets[b]:offsets[b+1]]``, read and collated."""

    def __init__(self, reader: BatchReader, ids: np.ndarray, offsets: np.ndarray, *, where: str,
                 transform: Callable | None = None, collate_fn: Callable | None = None, pad_id: int = 0):
        self.reader = reader
        self.ids = ids
        self.offsets = offsets
        self.where = where
        self.transform = transform
        self.collate_fn = collate_fn
        self.pad_id = pad_id

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def batch_ids(self, b: int) -> np.ndarray:
        return self.ids[self.offsets[b] : self.offsets[b + 1]]

    def __getitem__(self, b: int) -> Any:
        ids = self.batch_ids(b)
        try:
            if self.transform is None and self.collate_fn is None:
                # Only a worker's output crosses a process boundary: pack bytes there only.
                return self.reader.read_batch(ids, pack=get_worker_info() is not None)
            samples = self.reader.read_samples(ids)
            if self.transform is not None:
                samples = [self._transform(s, g) for s, g in zip(samples, ids.tolist())]
            if self.collate_fn is not None:
                return self.collate_fn(samples)
            return collate_samples(samples, pad_field=self.reader.pad_field, pad_id=self.pad_id,
                                   lengths=self.reader.index_lengths(ids))
        except Exception as e:
            e.add_note(f"while loading batch {b} of {self.where}: {describe_ids(self.reader, ids)}")
            raise

    def _transform(self, sample: dict, gid: int) -> Any:
        try:
            return self.transform(sample)
        except Exception as e:
            e.add_note(f"in transform of sample {sample.get('__key__')!r} ({self.reader.where(gid)})")
            raise


def make_dataloader(dataset: PlanBatches, start: int, *, num_workers: int, prefetch_factor: int,
                    pin_memory: bool, timeout: float) -> DataLoader:
    kwargs: dict[str, Any] = {}
    if num_workers > 0:
        kwargs.update(prefetch_factor=prefetch_factor, timeout=timeout, persistent_workers=False,
                      worker_init_fn=_worker_init)
    return DataLoader(
        dataset,
        batch_size=None,
        collate_fn=_as_is,
        sampler=range(start, len(dataset)),
        num_workers=num_workers,
        pin_memory=pin_memory,
        **kwargs,
    )


def _as_is(batch: Any) -> Any:
    # DataLoader's default (default_convert) walks every list element; our batches are ready.
    return batch


def _worker_init(_worker_id: int) -> None:
    # Reading and decoding are numpy-vectorised; intra-op threads per worker only oversubscribe.
    torch.set_num_threads(1)
