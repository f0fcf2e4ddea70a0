"""Measuring a cache directory and applying eviction decisions to it.

`Budget` is the one owner of the cache budget (``--max-bytes``, ``--min-free``): what the cache
may hold (`Budget.measure`: a scan and `evict.effective_limit`) and the eviction that makes room
for incoming bytes (`Room.make_room`). The warm (cache/warmfit.py), the loader's fetch-on-miss
(cache/dcache.py), the stager (cache/stagebudget.py) and ``shardtool cache gc`` decide by it; each
keeps only its own policy (refuse, best effort, evict nothing).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from ..format.errors import FormatError
from ..format.manifest import MANIFEST_NAME, Manifest, manifest_hash
from .cachedir import VersionDir, version_dirs
from .evict import Entry, effective_limit, eviction_order, plan_eviction
from .locks import try_exclusive


@dataclass
class Cached:
    vdir: VersionDir
    shard: int
    path: str
    size: int


def _load_manifest(root: str) -> Manifest | None:
    try:
        with open(os.path.join(root, MANIFEST_NAME), "rb") as f:
            return Manifest.from_json(f.read(), source=root)
    except (OSError, FormatError):
        return None


def cached_versions(cache_dir: str):
    """(VersionDir, Manifest) of every dataset version in the cache with a readable manifest."""
    for name in version_dirs(cache_dir):
        root = os.path.join(cache_dir, name)
        m = _load_manifest(root)
        if m is None:
            continue
        with open(os.path.join(root, MANIFEST_NAME), "rb") as f:
            yield VersionDir(cache_dir, manifest_hash(f.read())), m


def scan(
    cache_dir: str,
    *,
    current: VersionDir | None = None,
    assigned: set[int] | None = None,
    protected: AbstractSet[int] = frozenset(),
    keep: frozenset[str] = frozenset(),
    live: frozenset[str] | None = None,
) -> tuple[list[Entry], dict, int]:
    """Every cached shard file of every version as eviction entries; returns (entries, where, used).
    ``keep``: versions (the other datasets of a mixture) whose assigned shards are protected too.
    ``live``: versions running jobs on the node asked for; every other version is idle and goes
    first (None: nothing is known about jobs, no version is idle)."""
    entries: list[Entry] = []
    where: dict = {}
    used = 0
    for vd, m in cached_versions(cache_dir):
        is_current = current is not None and vd.root == current.root
        kept = not is_current and vd.version in keep
        mine = (
            (assigned if assigned is not None else vd.read_assigned())
            if is_current
            else vd.read_assigned()
            if kept
            else set()
        )
        for i, info in enumerate(m.shards):
            p = vd.path(info.path)
            try:
                st = os.stat(p)
            except OSError:
                continue
            key = (os.path.basename(vd.root), i)
            used += st.st_size
            entries.append(
                Entry(
                    key,
                    st.st_size,
                    i in mine,
                    vd.last_used(i) or st.st_mtime,
                    protected=(is_current and i in protected) or (kept and i in mine),
                    idle=live is not None and not is_current and vd.version not in live,
                )
            )
            where[key] = Cached(vd, i, p, st.st_size)
    return entries, where, used


def disk_free(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def evict(where: dict, entries: list[Entry], need: int) -> tuple[int, list]:
    """Remove shards in eviction order until ``need`` bytes are freed, skipping shards in use
    (their lock is held). Returns (bytes freed, keys evicted)."""
    freed, gone = 0, []
    for e in eviction_order(entries):
        if freed >= need:
            break
        c: Cached = where[e.key]
        with try_exclusive(c.vdir.lock_path(c.shard)) as held:
            if not held:
                continue  # being read or fetched right now: never evicted
            c.vdir.drop_stamp(c.shard)  # stamp first: a half-evicted shard is untrusted, never wrongly trusted
            with contextlib.suppress(FileNotFoundError):
                os.unlink(c.path)
        freed += c.size
        gone.append(e.key)
    return freed, gone


@dataclass(frozen=True)
class Budget:
    """What a cache may hold: at most ``max_bytes``, and ``min_free`` bytes left free on its disk."""

    max_bytes: int | None = None
    min_free: int | None = None

    @property
    def active(self) -> bool:
        """A limit is set (without one, nothing is scanned, evicted or refused)."""
        return self.max_bytes is not None or self.min_free is not None

    def measure(self, cache_dir: str, **scan_options) -> Room:
        """The cache as it is now (`scan` with ``scan_options``) and the bytes it may hold."""
        entries, where, used = scan(cache_dir, **scan_options)
        limit = effective_limit(used, disk_free(cache_dir), max_bytes=self.max_bytes, min_free=self.min_free)
        if limit is None:
            raise RuntimeError("shardtool internal error: measure() of an inactive budget")
        return Room(entries, where, used, limit)

    def flags(self) -> str:
        """The options that set it, for messages."""
        return f"--max-bytes={self.max_bytes}, --min-free={self.min_free}"


@dataclass
class Room:
    """A measured cache: its shards as eviction entries, the bytes they use and the limit."""

    entries: list[Entry]
    where: dict
    used: int
    limit: int

    def planned_shortfall(self, incoming: int) -> int:
        """Bytes short of fitting ``incoming`` even after evicting every shard that may go (0: fits)."""
        return plan_eviction(self.entries, used=self.used, limit=self.limit, incoming=incoming)[1]

    def make_room(self, incoming: int) -> tuple[int, list, int]:
        """Evict, in eviction order, what ``incoming`` bytes need: (bytes freed, keys evicted,
        bytes still short). Shards being read are skipped (`evict`), so it may free less than
        planned; where even every candidate would not do, nothing is evicted."""
        need = self.used + incoming - self.limit
        if need <= 0:
            return 0, [], 0
        short = self.planned_shortfall(incoming)
        if short:
            return 0, [], short
        freed, gone = evict(self.where, self.entries, need)
        return freed, gone, max(need - freed, 0)
