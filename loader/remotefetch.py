"""Record batches of a remote Arrow shard, fetched by range: neighbours in one request.

A shard read without a node cache is read record batch by record batch (`loader.batchcache`
keeps them decompressed for the pass). The record batches a training batch misses are fetched at
once: `RemoteBatches.runs` groups them into runs of neighbours within the coalescing gap
(`shardtool.format.coalesce`), each run one ranged request, the runs on the fetch pool's threads.

Handed down: before a pass forks its workers, the rank's process fetches the record batches of
the pass's first batches (`hand_down`, at most `HAND_DOWN_BYTES` of them) while it has nothing
else to do, and every worker inherits them. A forked worker's first request otherwise waits for
the worker to start and for its own S3 client (measured on moto: ~180 ms from the fork to its
first request, then the request), all on the way to the pass's first batch.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

import numpy as np
import pyarrow as pa

from ..format.coalesce import coalesce
from ..format.decompress import range_batch
from .observability.probe import NoProbe, Probe

__all__ = ["HAND_DOWN_BYTES", "RemoteBatches", "drop_handed", "hand_down"]

HAND_DOWN_BYTES = 64 << 20  # stored bytes a pass's first batches may hand down to its workers
# (dataset version, shard, sample) -> the verified stored bytes of that sample's record batch,
# fetched by the rank's process before its workers fork: module state, so a fork inherits it.
_HANDED: dict[tuple[str, int, int], memoryview] = {}


def hand_down(ds: Any, shard: int, samples: list[int], gap: int | None, watch: Any, pool: Any) -> Future:
    """Start fetching the record batches holding ``samples`` (one sample of each) of ``shard`` on
    ``pool``, kept for the workers forked next (`drop_handed` after the fork)."""

    def fetch() -> None:
        got = ds.verified_ranges(shard, samples, gap, watch)
        _HANDED.update({(ds.version, shard, i): data for i, data in zip(samples, got)})

    return pool.submit(fetch)


def drop_handed() -> None:
    """The rank's process, once its workers forked: they have their copies."""
    _HANDED.clear()


class RemoteBatches:
    """``fetch(samples)``: the verified record batches holding ``samples`` (one sample of each),
    in order, neighbours within ``gap`` bytes read as one request; announced to and counted by the
    rank's probe (under ``lock``: several threads fetch at once). A dataset
    packed before range checksums reads each batch through the shard's footer instead."""

    def __init__(self, ds: Any, shard: int, index: Any, gap: int | None, probe: Probe | NoProbe, lock: threading.Lock):
        self.ds, self.shard, self.index, self.gap = ds, shard, index, gap
        self.probe, self.lock = probe, lock

    def runs(self, samples: list[int]) -> list[list[int]]:
        """``samples`` (one of each record batch) grouped as they are read: one list per request,
        in offset order. A run joins consecutive record batches only: the bytes of a batch in
        between would be read and dropped, and fetched again when the pass needs it."""
        index = self.index
        if index.checksums is None or self.gap is None:
            return [[i] for i in samples]
        at = np.asarray(samples, dtype=np.int64)
        out = []
        for _, _, m in coalesce(index.offsets[at], index.sizes[at], self.gap):
            members = at[m]
            cuts = np.flatnonzero(np.diff(index.batch[members]) != 1) + 1
            out += [part.tolist() for part in np.split(members, cuts)]
        return out

    def __call__(self, samples: list[int]) -> list[pa.RecordBatch]:
        """The record batches holding ``samples``: one run as `runs` groups them (or one sample),
        so one request."""
        ds, shard = self.ds, self.shard
        handed = [_HANDED.pop((ds.version, shard, i), None) for i in samples] if _HANDED else []
        if not any(h is not None for h in handed):
            return ds.record_batches(shard, samples, self.gap, self.probe.requests(shard, self.lock))
        missing = [i for i, h in zip(samples, handed) if h is None]
        fetched = iter(
            ds.record_batches(shard, missing, self.gap, self.probe.requests(shard, self.lock)) if missing else []
        )
        schema, name = ds.batch_schema(shard), ds.manifest.shards[shard].path
        return [range_batch(h, schema, name) if h is not None else next(fetched) for h in handed]
