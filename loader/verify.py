"""Shards read in place — a local dataset opened without a cache — are verified before use.

The cache verifies every shard it copies, and a remote read checks each sample's byte range
against the checksum in its index; a local dataset is memory-mapped and read in place, so without
this module nothing would stop one flipped byte from reaching the training loop.

Each shard is hashed whole (xxh3-128, at memory speed) the first time a process maps it — before
any of its bytes are served — unless a *trust stamp* says this user already verified that very
file on this machine in this boot, as the cache trusts its shards (`shardtool.cache.durability`):
the stamp records the file's device, inode, size, mtime and ctime, so any write to the file voids
it, and the boot id, so a reboot (which may lose bytes the kernel had not written back) does too.
So a node hashes each shard once per boot, not once per process, rank, worker and epoch.

Why whole shards and not per-sample checksums of the ranges a batch reads: at ~350-token
samples a per-sample hash costs ~0.25 µs of Python call overhead for ~0.1 µs of hashing, about
13% of the loader's time, on every pass; a whole shard hashes at 10-15 GB/s from page cache
(page faults of the fresh map included, which its reads then no longer pay), once per boot. On
the loader benchmark's 200k-sample corpus that first pass costs ~9% of one in-process epoch and a
stamped pass nothing measurable. And the whole-shard hash covers every byte the loader parses
(tar headers, Arrow footers), not only the sample ranges.

Stamps live in the user's own cache directory (`shardtool.cache.usercache`: ``$SHARDTOOL_USER_CACHE``,
else ``$TMPDIR/shardtool-cache-<uid>``), which must belong to this user and be writable by no one
else — whoever can write it could vouch for a damaged shard. Where it is unusable, every process
hashes every shard it maps (correct, only slower), and says so in a warning.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping

from ..format import Dataset
from ..format.damage import check_shard_bytes

log = logging.getLogger(__name__)

STAMPS = ".verified-in-place"  # not a version directory name: cache gc/clear/ls pass it by


def stamp_dir(dataset: Dataset, env: Mapping[str, str]) -> str | None:
    """Where this user's stamps for ``dataset`` live, created if needed; None where they cannot."""
    from ..cache.cachedir import version_dirname
    from ..cache.errors import LocalFault
    from ..cache.usercache import own_cache_dir, user_cache_dir

    base = user_cache_dir(env)
    try:
        own_cache_dir(base, create=True)
        path = os.path.join(base, STAMPS, version_dirname(dataset.version))
        os.makedirs(path, mode=0o700, exist_ok=True)
        return path
    except (LocalFault, OSError) as e:
        log.warning("shards read in place are hashed in every process: no private directory for trust stamps (%s)", e)
        return None


def file_identity(st: os.stat_result) -> dict:
    """What changes whenever a file's bytes can have changed. ctime too: a write followed by
    os.utime (rsync -t, a restore) can put size and mtime back, but nothing can set ctime back."""
    return {
        "dev": st.st_dev,
        "ino": st.st_ino,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
    }


class InPlaceVerifier:
    """``check(shard, data, st)``: raise FormatError unless the mapped shard is the manifest's."""

    def __init__(self, dataset: Dataset, env: Mapping[str, str] | None = None):
        self.dataset = dataset
        self.dir = stamp_dir(dataset, os.environ if env is None else env)

    def stamp_path(self, shard: int) -> str | None:
        return None if self.dir is None else os.path.join(self.dir, str(shard))

    def check(self, shard: int, data, st: os.stat_result) -> None:
        """``data``: the whole shard as mapped; ``st``: the stat of the descriptor it was mapped from."""
        info = self.dataset.manifest.shards[shard]
        if self._trusted(shard, info.hash, st):
            return
        check_shard_bytes(self.dataset, shard, data)  # names the shard and its damaged samples
        self._stamp(shard, info.hash, st)

    def _trusted(self, shard: int, digest: str, st: os.stat_result) -> bool:
        from ..cache.durability import stamp_survives

        path = self.stamp_path(shard)
        if path is None:
            return False
        try:
            with open(path) as f:
                stamp = json.load(f)
        except (OSError, ValueError):
            return False
        return (
            isinstance(stamp, dict)
            and stamp_survives(stamp)
            and stamp.get("hash") == digest
            and all(stamp.get(k) == v for k, v in file_identity(st).items())
        )

    def _stamp(self, shard: int, digest: str, st: os.stat_result) -> None:
        from ..cache.durability import stamp_fields
        from ..cache.store import write_small

        path = self.stamp_path(shard)
        if path is None:
            return
        # Not fsynced, and never durable: the bytes were checked in this boot's page cache only.
        body = {"path": self.dataset.shard_path(shard), **file_identity(st), "hash": digest, **stamp_fields(False)}
        try:
            write_small(path, json.dumps(body).encode())
        except OSError as e:  # a full or read-only /tmp costs a re-hash later, nothing else
            log.debug("cannot write trust stamp %s: %s", path, e)
