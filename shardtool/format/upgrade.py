"""Upgrading a dataset packed by an older shardtool: store the per-shard summaries it lacks.

A dataset without ``summaries.arrow`` (packed before they existed), or with summaries that no
longer match its lengths, still loads: every rank computes them from the whole lengths file,
with a `SummariesMissing` warning. `upgrade` computes them once from ``lengths.npy`` and writes
``summaries.arrow`` beside the manifest — atomically on a local filesystem (temp file, fsync,
rename), as one object write on an object store. The manifest is never touched: the summaries
are bound to the lengths by the lengths file's hash, so the dataset's version, the node caches
keyed on it and saved loader states all stay valid.
"""

from __future__ import annotations

import posixpath
import time
from dataclasses import asdict, dataclass

from .atomic import atomic_write_bytes
from .dataset import Dataset, is_local
from .errors import FormatError
from .summaries import SUMMARIES_NAME
from .writer import summaries_bytes

__all__ = ["UpgradeReport", "upgrade_dataset"]


@dataclass
class UpgradeReport:
    url: str
    version: str
    shards: int
    samples: int
    needed: bool  # the dataset lacked usable summaries when looked at
    reason: str  # why ("" when it did not need one)
    written: str | None = None  # the file written, when upgraded
    bytes: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        short = self.version.split(":")[-1][:12]
        where = f"dataset {self.url} ({self.shards:,} shards, {self.samples:,} samples, version {short})"
        if not self.needed:
            return f"{where} is up to date: its per-shard summaries match its lengths; nothing to do"
        if self.written is None:
            return f"{where} {self.reason}: needs an upgrade (run without --check to store its summaries)"
        return (
            f"{where} {self.reason}: upgraded, wrote {self.written} ({self.bytes:,} bytes) in "
            f"{self.seconds:.2f} s; index.json and the dataset version are unchanged, so node caches and "
            "loader states stay valid"
        )


def upgrade_dataset(url: str, *, storage_options: dict | None = None, check: bool = False) -> UpgradeReport:
    """Store ``url``'s per-shard summaries if it lacks usable ones (only report, with ``check``).

    FormatError names the file when the dataset itself is unreadable (its lengths file does not
    match the manifest's hash, say); nothing is written then."""
    began = time.perf_counter()
    ds = Dataset(url, storage_options=storage_options)
    stored, reason = ds.stored_summaries(ds.read_summaries_bytes())
    report = UpgradeReport(url, ds.version, ds.num_shards, len(ds), stored is None, reason)
    if stored is not None or check:
        return report
    # ds.lengths checks them against the manifest's hash. No sketch: the node ranges, and so the
    # node caches and loader states of this dataset, stay what they were (format.sketch).
    data = summaries_bytes(ds.manifest, ds.lengths, sketch=False)
    path = posixpath.join(ds.root, SUMMARIES_NAME) if ds.root else SUMMARIES_NAME
    if is_local(ds.fs):
        atomic_write_bytes(path, data)
    else:
        ds.fs.pipe_file(path, data)  # one PUT: an object appears whole or not at all
        ds.fs.invalidate_cache(path)
    # Read back what readers will read: the upgrade is done only if it loads without a warning.
    written = Dataset(url, storage_options=storage_options)
    check_again, why = written.stored_summaries(written.read_summaries_bytes())
    if check_again is None:
        raise FormatError(f"{url}: wrote {path} but it does not read back as this dataset's summaries: {why}")
    report.written, report.bytes, report.seconds = path, len(data), time.perf_counter() - began
    return report
