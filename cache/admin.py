"""``shardtool cache ls|verify|gc|clear``: inspect and maintain a cache directory.

Every removal of a shard takes its lock without waiting and skips shards in use, so maintenance
is safe while a loader reads or a warmer writes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from typing import TypedDict

from ..format.summaries import SUMMARIES_NAME
from .budget import Budget, cached_versions, evict
from .cachedir import META_DIR, lengths_rel, read_sources
from .locks import try_exclusive
from .meta import stamp_found_intact, summaries_usable
from .plain import found_intact, remove_leftovers, stored_copy_path, stored_shard_of
from .store import read_verified_local, temp_target

TEMP_GRACE_S = 600  # a metadata temp file untouched this long belongs to a dead writer


class VerifyReport(TypedDict):
    ok: int  # shards that hashed intact
    bad: list[str]  # shard files that did not (removed unless remove_bad=False)
    busy: list[str]  # shard files locked by a reader or fetcher: checked by their holder
    metadata_bad: list[str]  # lengths files and sample indexes that did not hash intact


class GcReport(TypedDict):
    temps_removed: int
    versions_removed: list[str]  # version directory names
    evicted_shards: int
    evicted_bytes: int


class ClearReport(TypedDict):
    removed: list[str]  # version directory names
    busy: list[str]  # shard files in use, left in place


def ls(cache_dir: str) -> list[dict]:
    urls: dict[str, list[str]] = {}
    for url, entry in read_sources(cache_dir).items():
        if isinstance(entry, dict):
            urls.setdefault(entry.get("dir", ""), []).append(url)
    out = []
    for vd, m in cached_versions(cache_dir):
        name = os.path.basename(vd.root)
        cached = [i for i, s in enumerate(m.shards) if vd.trusted(i, s)]
        present = sum(1 for s in m.shards if os.path.exists(vd.path(s.path)))
        out.append(
            {
                "dir": name,
                "version": vd.version,
                "urls": urls.get(name, []),
                "shards": len(m.shards),
                "cached": len(cached),
                "untrusted_present": present - len(cached),
                "cached_bytes": sum(_size(vd.path(m.shards[i].path)) for i in cached),  # plain where decompressed
                "dataset_bytes": m.num_bytes,
                "assigned": len(vd.read_assigned()),
            }
        )
    return out


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def verify(cache_dir: str, *, remove_bad: bool = True) -> VerifyReport:
    """Hash every cached shard and metadata file; bad ones are removed (the next warm refetches)."""
    res: VerifyReport = {"ok": 0, "bad": [], "busy": [], "metadata_bad": []}
    for vd, m in cached_versions(cache_dir):
        lf = m.lengths_file
        if (
            os.path.exists(vd.path(lengths_rel(m)))
            and read_verified_local(vd.path(lengths_rel(m)), size=lf.get("bytes"), digest=lf.get("hash")) is None
        ):
            res["metadata_bad"].append(vd.path(lengths_rel(m)))
            if remove_bad:
                os.unlink(vd.path(lengths_rel(m)))
        sp = vd.path(SUMMARIES_NAME)
        found = read_verified_local(sp, size=None, digest=None)  # not in the manifest: checked against it
        if found is not None and not summaries_usable(found, m):
            res["metadata_bad"].append(sp)
            if remove_bad:
                os.unlink(sp)
        for i, info in enumerate(m.shards):
            ip = vd.path(info.index)
            if os.path.exists(ip) and read_verified_local(ip, size=info.index_bytes, digest=info.index_hash) is None:
                res["metadata_bad"].append(ip)
                if remove_bad:
                    os.unlink(ip)
            p = vd.path(info.path)
            if not os.path.exists(p):
                continue
            with try_exclusive(vd.lock_path(i)) as held:
                if not held:
                    res["busy"].append(p)  # being fetched or read: checked by its holder
                    continue
                form, record = found_intact(vd, i, info, p)  # a plain copy: against its recorded hash
                if form is not None:
                    res["ok"] += 1
                    stamp_found_intact(vd, i, info, record)
                else:
                    res["bad"].append(p)
                    vd.drop_stamp(i)
                    if remove_bad:
                        os.unlink(p)
    return res


def _remove_temps(cache_dir: str) -> int:
    n = 0
    now = time.time()
    for vd, m in cached_versions(cache_dir):
        shard_of = {os.path.basename(vd.path(s.path)): i for i, s in enumerate(m.shards)}
        for dirpath, dirnames, filenames in os.walk(vd.root):
            dirnames[:] = [d for d in dirnames if d != META_DIR] if dirpath == vd.root else dirnames
            for fn in filenames:
                base = temp_target(fn)
                if base is None:
                    continue
                p = os.path.join(dirpath, fn)
                if base in shard_of:
                    with try_exclusive(vd.lock_path(shard_of[base])) as held:
                        if held:
                            with contextlib.suppress(OSError):
                                os.unlink(p)
                                n += 1
                else:
                    with contextlib.suppress(OSError):
                        if now - os.stat(p).st_mtime > TEMP_GRACE_S:
                            os.unlink(p)
                            n += 1
        n += _remove_stored_leftovers(vd, m)
    return n


def _remove_stored_leftovers(vd, m) -> int:
    """A killed warm's copies of compressed shards waiting to be decompressed (``.shardtool/stored``:
    the stored bytes and their temps, up to a compressed shard each), where no one holds the shard."""
    folder = os.path.dirname(stored_copy_path(vd, 0))
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    n = 0
    for shard in sorted({s for s in map(stored_shard_of, names) if s is not None and s < len(m.shards)}):
        with try_exclusive(vd.lock_path(shard)) as held:
            if held:
                n += remove_leftovers(vd, shard, vd.path(m.shards[shard].path))
    return n


def gc(
    cache_dir: str, *, max_bytes: int | None = None, min_free: int | None = None, unreferenced: bool = False
) -> GcReport:
    """Remove dead writers' temp files, optionally versions no URL points at, then evict to budget."""
    res: GcReport = {
        "temps_removed": _remove_temps(cache_dir),
        "versions_removed": [],
        "evicted_shards": 0,
        "evicted_bytes": 0,
    }
    if unreferenced:
        live = {e.get("dir") for e in read_sources(cache_dir).values() if isinstance(e, dict)}
        for vd, _ in list(cached_versions(cache_dir)):
            if (
                os.path.basename(vd.root) not in live
                and not clear(cache_dir, version_dir=os.path.basename(vd.root))["busy"]
            ):
                res["versions_removed"].append(os.path.basename(vd.root))
    budget = Budget(max_bytes, min_free)
    if budget.active:
        room = budget.measure(cache_dir)
        if room.used > room.limit:
            freed, gone = evict(room.where, room.entries, room.used - room.limit)
            res["evicted_shards"], res["evicted_bytes"] = len(gone), freed
    return res


def clear(cache_dir: str, *, version_dir: str | None = None) -> ClearReport:
    """Remove cached versions (all, or one directory name); shards in use are left in place."""
    res: ClearReport = {"removed": [], "busy": []}
    for vd, m in list(cached_versions(cache_dir)):
        name = os.path.basename(vd.root)
        if version_dir is not None and name != version_dir:
            continue
        busy = False
        for i, info in enumerate(m.shards):
            p = vd.path(info.path)
            if not os.path.exists(p):
                continue
            with try_exclusive(vd.lock_path(i)) as held:
                if not held:
                    busy = True
                    res["busy"].append(p)
                    continue
                vd.drop_stamp(i)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)
        if not busy:
            # Manifest first: without it the directory is no longer a cached version.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(vd.manifest_path)
            shutil.rmtree(vd.root, ignore_errors=True)
            res["removed"].append(name)
    return res
