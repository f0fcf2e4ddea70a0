"""When a published shard may be trusted without being on disk yet.

A shard is renamed into place only after its bytes were verified against the manifest, so within
one boot of the machine the page cache is the truth and the shard is correct whether or not the
kernel has written it back: a SIGKILLed warmer leaves the page cache intact. Only a crash of the
machine itself (power loss, kernel panic) can lose bytes the kernel had not yet written back,
and that always changes the kernel's boot id. So a trust stamp records the boot it was written
in and whether its shard was fsynced; a stamp of another boot whose shard was not fsynced is not
trusted, and the shard is hashed again before anything reads it (``shardtool.cache.meta.ensure_shard``).

That lets a warm publish at page-cache speed (as ``cp`` does) and still never serve bytes lost
in a crash; ``durable=True`` fsyncs every shard before its rename instead (as ``cp; sync``), so
nothing needs re-hashing after a reboot. Where the boot id is unknown, every shard is fsynced.
"""

from __future__ import annotations

import functools

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


@functools.lru_cache(maxsize=1)
def boot_id() -> str | None:
    """This boot's id (Linux); None where the kernel does not expose one."""
    try:
        with open(BOOT_ID_PATH) as f:
            return f.read().strip() or None
    except OSError:
        return None


def must_fsync(durable: bool) -> bool:
    """Whether a shard must be fsynced before it is published."""
    return durable or boot_id() is None


def stamp_fields(fsynced: bool) -> dict:
    return {"boot": boot_id(), "durable": bool(fsynced)}


def stamp_survives(stamp: dict) -> bool:
    """Whether a stamp still vouches for its shard's bytes: fsynced, or written in this boot.
    Stamps from before the boot id was recorded were always fsynced."""
    if "boot" not in stamp:
        return True
    return bool(stamp.get("durable")) or (stamp["boot"] is not None and stamp["boot"] == boot_id())
