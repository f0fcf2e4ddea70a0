"""Record batches of a remote Arrow shard, fetched by range: neighbours in one request.

A shard read without a node cache is read record batch by record batch (`loader.batchcache`
keeps them decompressed for the pass). The record batches a training batch misses are fetched at
once: `RemoteBatches.runs` groups them into runs of neighbours within the coalescing gap
(`shardtool.format.coalesce`), each run one ranged request, the runs on the fetch pool's threads.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pyarrow as pa

from ..format.coalesce import coalesce
from .observability.probe import NoProbe, Probe

__all__ = ["RemoteBatches"]


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
        return self.ds.record_batches(self.shard, samples, self.gap, self.probe.requests(self.shard, self.lock))
