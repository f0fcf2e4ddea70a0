"""Where things live in a cache directory, and when a cached file is trusted.

::

    CACHE_DIR/
      sources.json                 url -> dataset version last seen there (for offline starts)
      <algo>-<hex>/                one directory per dataset version: itself a dataset root (except that a
                                   compressed dataset's shards are plain here: read it through open_cache)
        index.json  lengths.npy    same names and relative shard/index paths as the source
        <shard paths> <index paths>
        .shardtool/locks/<i>.lock  per-shard flock (exclusive: fetch/evict, shared: read)
        .shardtool/ok/<i>          trust stamp: size, mtime_ns, ctime_ns, inode and hash of the verified
                                   shard, the boot it was written in and whether the shard was fsynced
        .shardtool/assigned.json   the shards the last warm assigned to this node
        .shardtool/plain/<i>       size and hash of a compressed shard's plain copy (cache/plain.py)
        .shardtool/stored/<i>      its verified stored bytes while it is decompressed (under its lock)
        .shardtool/keep-compressed the last warm ran with --keep-compressed (fetch-on-miss follows it)

A shard is published only after its size and hash matched the manifest; the stamp written after
the rename records the file's stat, so later checks are one ``stat`` per shard. Any change to the
file (size, mtime, ctime, inode) voids the stamp and the shard is hashed again before it is trusted;
so does a reboot for a shard that was published without an fsync (:mod:`shardtool.cache.durability`).
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import stat
import time

from ..format.manifest import LENGTHS_NAME, MANIFEST_NAME, ShardInfo
from .durability import stamp_fields, stamp_survives
from .locks import locked
from .perms import DEFAULT_PERMS, Perms
from .store import local_fault, write_small

SOURCES_NAME = "sources.json"
META_DIR = ".shardtool"


def version_dirname(version: str) -> str:
    return version.replace(":", "-")


def normalize_url(url: str) -> str:
    url = str(url)
    if "://" not in url:
        return os.path.abspath(url)
    if url.startswith("file://"):
        return os.path.abspath(url[len("file://") :])
    return url.rstrip("/")


class VersionDir:
    """Paths and trust stamps of one dataset version inside a cache directory; ``perms``: the
    modes and group of what is written into it (:mod:`cache.perms`)."""

    def __init__(self, cache_dir: str, version: str, perms: Perms = DEFAULT_PERMS):
        self.cache_dir = os.path.abspath(cache_dir)
        self.version = version
        self.perms = perms
        self.root = os.path.join(self.cache_dir, version_dirname(version))
        self.meta = os.path.join(self.root, META_DIR)

    def path(self, rel: str) -> str:
        return os.path.join(self.root, *posixpath.normpath(rel).split("/"))

    @property
    def manifest_path(self) -> str:
        return os.path.join(self.root, MANIFEST_NAME)

    def lock_path(self, shard: int) -> str:
        return os.path.join(self.meta, "locks", f"{shard}.lock")

    def stamp_path(self, shard: int) -> str:
        return os.path.join(self.meta, "ok", str(shard))

    @property
    def assigned_path(self) -> str:
        return os.path.join(self.meta, "assigned.json")

    # ------------------------------------------------------------- trust stamps
    def trusted(self, shard: int, info: ShardInfo) -> bool:
        """True if the shard file is exactly the one verified when its stamp was written."""
        return self.trusted_form(shard, info) is not None

    def trusted_form(self, shard: int, info: ShardInfo) -> str | None:
        """ "stored" (the manifest's bytes), "plain" (a compressed shard decompressed on its way
        in, :mod:`cache.plain`) or None where the stamp does not vouch for the file."""
        try:
            st = os.stat(self.path(info.path))
            with open(self.stamp_path(shard)) as f:
                stamp = json.loads(f.read())
        except (OSError, ValueError):
            return None
        # ctime too: a write followed by os.utime (rsync -t, a restore) can put size and mtime back,
        # but nothing can set ctime back.
        if not (
            isinstance(stamp, dict)
            and stamp_survives(stamp)
            and stamp.get("size") == st.st_size
            and stamp.get("mtime_ns") == st.st_mtime_ns
            and stamp.get("ctime_ns") == st.st_ctime_ns
            and stamp.get("ino") == st.st_ino
        ):
            return None
        if "stored_hash" in stamp:  # a plain copy: its own hash, tied to the manifest's stored hash
            return "plain" if stamp["stored_hash"] == info.hash else None
        return "stored" if st.st_size == info.bytes and stamp.get("hash") == info.hash else None

    def write_stamp(self, shard: int, info: ShardInfo, *, fsynced: bool, plain: dict | None = None) -> None:
        """``plain``: the record of a decompressed copy (its size and hash, `cache.plain`)."""
        st = os.stat(self.path(info.path))
        body = {
            "size": st.st_size,
            "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns,
            "ino": st.st_ino,
            "hash": info.hash if plain is None else plain["hash"],
            **stamp_fields(fsynced),
        }
        if plain is not None:
            body["stored_hash"] = info.hash
        # Not fsynced: a stamp lost in a crash only costs one re-hash; a torn one fails to parse.
        write_small(self.stamp_path(shard), json.dumps(body).encode(), perms=self.perms)

    def drop_stamp(self, shard: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.stamp_path(shard))

    def touch(self, shard: int) -> None:
        """Mark the shard used now (the stamp's mtime is its LRU clock; atime is often off)."""
        with contextlib.suppress(OSError):
            os.utime(self.stamp_path(shard))

    def last_used(self, shard: int) -> float:
        try:
            return os.stat(self.stamp_path(shard)).st_mtime
        except OSError:
            return 0.0

    def read_assigned(self) -> set[int]:
        try:
            with open(self.assigned_path) as f:
                return set(json.load(f).get("shards", []))
        except (OSError, ValueError):
            return set()

    def write_assigned(self, shards: list[int], layout: dict) -> None:
        """Not fsynced: an eviction hint, rewritten by every warm."""
        body = {"shards": sorted(shards), "layout": layout, "written": time.time()}
        write_small(self.assigned_path, json.dumps(body).encode(), perms=self.perms)


def lengths_rel(manifest) -> str:
    return manifest.lengths_file.get("path", LENGTHS_NAME)


# ---------------------------------------------------------------- sources record
def read_sources(cache_dir: str) -> dict:
    try:
        with open(os.path.join(cache_dir, SOURCES_NAME)) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _recorded(cache_dir: str, key: str, entry: dict, perms: Perms) -> bool:
    """The record is there, readable with the cache's mode (a cache written before files got it
    has a 0600 sources.json, which the job's user cannot read: rewriting it fixes that)."""
    if {k: read_sources(cache_dir).get(key, {}).get(k) for k in entry} != entry:
        return False
    try:
        st = os.stat(os.path.join(cache_dir, SOURCES_NAME))
    except OSError:
        return False
    return st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) == perms.mode


def record_source(cache_dir: str, url: str, version: str, *, perms: Perms = DEFAULT_PERMS) -> None:
    """Remember which version this URL served last, so an offline loader can find it. A cache
    that cannot take the write (full, read-only) is a LocalFault, as for any cached file; one
    that already has the record is not written, so reading needs no write access."""
    key = normalize_url(url)
    entry = {"version": version, "dir": version_dirname(version)}
    if _recorded(cache_dir, key, entry, perms):
        return
    try:
        with locked(os.path.join(cache_dir, ".sources.lock"), perms=perms):
            if _recorded(cache_dir, key, entry, perms):
                return
            data = read_sources(cache_dir)
            data[key] = {**entry, "updated": time.time()}
            write_small(
                os.path.join(cache_dir, SOURCES_NAME), json.dumps(data, indent=1).encode(), perms=perms, durable=True
            )
    except OSError as e:
        raise local_fault(e, f"{SOURCES_NAME} of cache {cache_dir}") from None


def recorded_version(cache_dir: str, url: str) -> str | None:
    entry = read_sources(cache_dir).get(normalize_url(url))
    return entry.get("version") if isinstance(entry, dict) else None


def version_dirs(cache_dir: str) -> list[str]:
    """Names of the version directories present in ``cache_dir``."""
    try:
        names = sorted(os.listdir(cache_dir))
    except FileNotFoundError:
        return []
    return [n for n in names if "-" in n and os.path.isfile(os.path.join(cache_dir, n, MANIFEST_NAME))]
