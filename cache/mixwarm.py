"""Warm every source of a mixture into one node cache in one call (docs/architecture.md §3): one report.

Each source is warmed exactly as a single dataset (its own node range under the same layout, its
own version directory), one after another so that every source's transfers get all ``jobs``.
A cache budget covers them all: a source's warm never evicts the shards another source of the
mixture has assigned to this node, so warming the last source cannot undo the first.

Failure policy, as for one dataset: a local fault (cache unusable, over budget) stops the warm
(exit 3: this node cannot hold its shards); a remote failure of one source is recorded and the
others are still warmed (exit 0, 1 with ``strict``); a source URL with no dataset is a usage
error (exit 2) after the others are warmed.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from ..plan.mixture import Mixture, MixtureError
from .cachedir import recorded_version
from .errors import EXIT_USAGE
from .report import WarmReport
from .warmer import warm

__all__ = ["MixtureWarmReport", "warm_mixture"]

# Worst first: the status of a mixture's warm is its worst source's.
_SEVERITY = ["local_fault", "usage_error", "remote_failed", "partial", "cached", "ok"]


@dataclass
class MixtureWarmReport:
    """What a mixture's warm did: one `WarmReport` per source, and their worst status."""

    mixture: str
    cache_dir: str
    reports: dict[str, WarmReport] = field(default_factory=dict)
    file_error: str | None = None  # the mixture file itself could not be used
    seconds: float = 0.0

    @property
    def status(self) -> str:
        if self.file_error is not None:
            return "usage_error"
        statuses = [r.status for r in self.reports.values()] or ["ok"]
        return min(statuses, key=_SEVERITY.index)

    @property
    def exit_code(self) -> int:
        if self.file_error is not None:
            return EXIT_USAGE
        codes = {r.status: r.exit_code for r in self.reports.values()}
        return codes.get(self.status, 0)

    @property
    def warnings(self) -> list[str]:
        return [f"source {name!r}: {w}" for name, r in self.reports.items() for w in r.warnings]

    @property
    def error(self) -> str | None:
        """The mixture file's error, or the first source's with the worst status, named."""
        if self.file_error is not None:
            return self.file_error
        bad = [(n, r) for n, r in self.reports.items() if r.error and r.status == self.status]
        return f"source {bad[0][0]!r}: {bad[0][1].error}" if bad else None

    def summary(self) -> str:
        lines = [f"source {name!r}: {r.summary()}" for name, r in self.reports.items()]
        copied = sum(r.bytes_copied for r in self.reports.values())
        assigned = sum(r.assigned_bytes for r in self.reports.values())
        lines.append(
            f"mixture {self.mixture}: warm {self.status}: {len(self.reports)} source(s), "
            f"{assigned / 1e9:.2f} GB assigned, {copied / 1e9:.2f} GB copied in {self.seconds:.2f}s"
        )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "mixture": self.mixture,
            "cache_dir": self.cache_dir,
            "status": self.status,
            "exit_code": self.exit_code,
            "error": self.error,
            "seconds": round(self.seconds, 4),
            "sources": {name: r.to_dict() for name, r in self.reports.items()},
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)


def warm_mixture(path: str, cache_dir: str, *, timeout: float | None = None, **options: Any) -> MixtureWarmReport:
    """Warm every source of the mixture file ``path`` into ``cache_dir`` for this node: the
    arguments of `shardtool.cache.warm` (placement, data_layout, budget, retries, ...) apply to
    each source; ``timeout`` to the whole call. Never raises for remote or local failures."""
    began = time.monotonic()
    report = MixtureWarmReport(path, cache_dir)
    try:
        mixture = Mixture.from_file(path)
    except MixtureError as e:
        report.file_error = str(e)
        return report
    done: dict[str, str] = {}  # name -> version warmed in this call
    for src in mixture.sources:
        others = [s for s in mixture.sources if s.name != src.name]
        versions = (done.get(s.name) or recorded_version(cache_dir, s.url) for s in others)
        keep = {v for v in versions if v is not None}
        left = None if timeout is None else max(timeout - (time.monotonic() - began), 0.0)
        r = warm(src.url, cache_dir, timeout=left, keep=keep, **options)
        report.reports[src.name] = r
        if r.version is not None:
            done[src.name] = r.version
        if r.status == "local_fault":
            break  # this node cannot hold its shards: the rest would fail alike
    report.seconds = time.monotonic() - began
    return report
