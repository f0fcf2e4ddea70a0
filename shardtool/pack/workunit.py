"""The unit of packing work: one piece of one source that a worker packs (see .units).

Its own module so that every source reader (.units, .foreign and the readers it loads) can name it
without importing the module that dispatches to them."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

# Other loaders' datasets (see .foreign) read as record batches, like Parquet.
FOREIGN = ("megatron", "mds", "litdata")
STRUCTURED = ("jsonl", "parquet", "arrow", "memory") + FOREIGN


@dataclass(frozen=True)
class Unit:
    kind: str  # jsonl | parquet | arrow | tar | tree | files | images | memory (sources.py) | FOREIGN (foreign.py)
    path: str
    start: int = 0  # jsonl: byte offset; parquet: row group; arrow: first batch; tree: first sample
    stop: int = -1
    count: int = -1  # samples (jsonl: lines) or -1 if not known without reading
    first_line: int = 0  # jsonl: line number of the chunk's first line in its file
    weight: int = 1  # bytes (or an estimate), for balancing
    # tree: ((key, ((ext, path), ...)), ...); files: ((key, relative path, path), ...);
    # images: ((key, field, label, path), ...)
    members: tuple = field(default=(), compare=False)
    # memory: the source's adapter; images: the tree's class names, in label order
    obj: Any = field(default=None, compare=False, repr=False)

    @property
    def stream(self) -> bool:
        """A one-shot source (a generator, a RecordBatchReader): read once, by one process."""
        return self.kind == "memory" and self.count < 0

    @property
    def structured(self) -> bool:
        return self.kind in STRUCTURED


def inputs_seen(units: list[Unit], skipped: int) -> dict[str, Any]:
    """What a job-array task found in its sources, for `shardtool merge` to compare: every task
    splits the same list of units, so tasks that found different ones (a glob that matched other
    files by then) would leave samples out, or pack some twice, without an error."""
    digest = hashlib.sha256()
    for u in units:
        digest.update(f"{u.kind}\0{u.path}\0{u.start}\0{u.stop}\0{u.count}\0{u.weight}\n".encode())
    return {
        "units": len(units),
        "sources": len({u.path for u in units}),
        "skipped": skipped,
        "digest": digest.hexdigest()[:16],
    }
