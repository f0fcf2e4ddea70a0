"""Cutting one worker's samples into shards: a new shard when the next sample would pass the
size or count limit, whether samples arrive one at a time or as whole batches."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..format.errors import BadSampleError
from ..format.tarshard import BLOCK
from ..format.writer import ShardFileWriter


def shard_name(task: int, worker: int, seq: int, fmt: str) -> str:
    return f"shards/t{task:04d}-w{worker:02d}-{seq:06d}.{fmt}"


class Roller:
    """Opens, fills and finishes one worker's shards, appending to ``result``."""

    def __init__(self, job, result):
        self.job = job
        self.result = result
        self.seq = 0
        self.w: ShardFileWriter | None = None
        self.cur_bytes = 0

    def _open_next(self) -> ShardFileWriter:
        job = self.job
        w = self.w = ShardFileWriter(
            job.out,
            shard_name(job.task, job.worker, self.seq, job.fmt),
            job.fmt,
            job.fields,
            compression=job.compression,
            batch_bytes=job.record_batch_size,
        )
        self.seq += 1
        self.cur_bytes = 0
        return w

    def add(self, key, values, payloads, length, sample_bytes, source, where) -> None:
        job = self.job
        if job.shard_size is not None and sample_bytes > job.shard_size:
            raise BadSampleError(
                f"sample {key!r} is {sample_bytes} bytes, larger than the shard size ({job.shard_size} bytes)",
                source=source,
                position=where,
            )
        if self.w is not None and (
            (job.samples_per_shard is not None and self.w.count >= job.samples_per_shard)
            or (job.shard_size is not None and self.cur_bytes + sample_bytes + 2 * BLOCK > job.shard_size)
        ):
            self.finish()
        w = self.w if self.w is not None else self._open_next()
        w.add_encoded(key, values, payloads, length)
        self.cur_bytes += sample_bytes

    def add_batch(self, offsets: np.ndarray, put: Callable[[ShardFileWriter, int, int], None]) -> None:
        """Samples ``0..n-1`` whose cumulative sizes are ``offsets`` (n + 1,): the same shard cuts
        as calling :meth:`add` per sample. ``put(writer, i, j)`` appends samples ``i..j-1``."""
        job = self.job
        n = len(offsets) - 1
        i = 0
        while i < n:
            w = self.w if self.w is not None else self._open_next()
            have = w.count
            k = n - i
            if job.samples_per_shard is not None:
                k = min(k, job.samples_per_shard - have)
            if job.shard_size is not None and k > 0:
                # Sample i+m fits while cur + (offsets[i+m+1] - offsets[i]) + 2 blocks <= limit.
                room = job.shard_size - 2 * BLOCK - self.cur_bytes + int(offsets[i])
                k = min(k, int(np.searchsorted(offsets[i + 1 : i + 1 + k], room, side="right")))
            if k <= 0:
                if have == 0:
                    k = 1  # a fresh shard always takes the next sample
                else:
                    self.finish()
                    continue
            j = i + k
            put(w, i, j)
            self.cur_bytes += int(offsets[j]) - int(offsets[i])
            i = j

    def finish(self) -> None:
        if self.w is None:
            return
        info, lengths = self.w.finish()
        self.result.shards.append(info.to_dict())
        self.result.lengths.append(lengths)
        self.result.keys.append(self.w.index_keys)
        self.w = None

    def abort(self) -> None:
        if self.w is not None:
            self.w.abort()
            self.w = None
