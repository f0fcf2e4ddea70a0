"""Making one item present and trusted in a version directory: the manifest, the lengths file,
a sample index, a shard. Shared by the warmer and the loader's fetch-on-miss, so both use the
same verification and the same per-shard locks.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import TypedDict

import numpy as np

from ..format.atomic import fsync_path
from ..format.manifest import Manifest, ShardInfo
from ..format.summaries import SUMMARIES_NAME, stored_summaries
from .cachedir import VersionDir, lengths_rel
from .durability import must_fsync
from .errors import CacheError, LocalFault, NotCached, RemoteError, SourceMissing
from .locks import DONE, TIMED_OUT, exclusive_unless
from .plain import decompress, found_intact, remove_leftovers, stored_copy_path
from .retry import RetryPolicy
from .store import Origin, copy_shard, local_fault, read_verified_local, store_verified

HIT, VERIFIED, COPIED = "hit", "verified", "copied"


class FetchOptions(TypedDict):
    """How a miss is fetched from the source: the keyword arguments every ``ensure_*`` takes."""

    policy: RetryPolicy
    deadline: float | None  # time.monotonic() past which no request starts; None: no deadline


def store_manifest(vd: VersionDir, manifest_bytes: bytes) -> None:
    if read_verified_local(vd.manifest_path, size=len(manifest_bytes), digest=None) == manifest_bytes:
        return
    store_verified(
        vd.manifest_path, manifest_bytes, size=None, digest=None, what=f"manifest of {vd.version}", perms=vd.perms
    )


def ensure_small(
    vd: VersionDir,
    rel: str,
    size: int | None,
    digest: str | None,
    src: Origin | None,
    *,
    policy: RetryPolicy,
    deadline: float | None,
    what: str,
) -> bytes:
    """A small verified file (lengths, sample index): the cached copy, else fetched and stored."""
    path = vd.path(rel)
    data = read_verified_local(path, size=size, digest=digest)
    if data is not None:
        return data
    if src is None:
        raise NotCached(f"{what} is not in the cache {vd.root} and the source is unavailable")
    data = src.read_bytes(rel, policy=policy, deadline=deadline)
    store_verified(path, data, size=size, digest=digest, what=what, perms=vd.perms)
    return data


def ensure_lengths(
    vd: VersionDir, manifest: Manifest, src: Origin | None, *, policy: RetryPolicy, deadline: float | None
) -> bytes:
    lf = manifest.lengths_file
    return ensure_small(
        vd,
        lengths_rel(manifest),
        lf.get("bytes"),
        lf.get("hash"),
        src,
        policy=policy,
        deadline=deadline,
        what=f"lengths file {lengths_rel(manifest)}",
    )


def ensure_summaries(
    vd: VersionDir,
    src: Origin | None,
    manifest: Manifest | None = None,
    *,
    policy: RetryPolicy,
    deadline: float | None,
) -> bytes | None:
    """The per-shard summaries file, or None where the source has none (a dataset packed before
    they existed). Not in the manifest by hash: with ``manifest`` a cached copy that does not agree
    with it (`summaries_usable`) is fetched again from ``src`` and replaced. A damaged copy was
    kept, and the node planned from summaries computed from the lengths (no weight sketch): other
    ranges than the other nodes', so two nodes read some samples both."""
    try:
        data = ensure_small(
            vd, SUMMARIES_NAME, None, None, src, policy=policy, deadline=deadline, what="per-shard summaries"
        )
    except SourceMissing:
        return None
    if manifest is None or src is None or summaries_usable(data, manifest):
        return data
    try:
        fresh = src.read_bytes(SUMMARIES_NAME, policy=policy, deadline=deadline)
    except RemoteError:  # SourceMissing among them
        return data  # offline: planned from the lengths, and the ranks' agreement check compares
    if not summaries_usable(fresh, manifest):
        return data  # the source's own copy is unusable too: planned as the source's readers plan it
    store_verified(vd.path(SUMMARIES_NAME), fresh, size=None, digest=None, what="per-shard summaries", perms=vd.perms)
    return fresh


def summaries_usable(data: bytes, manifest: Manifest) -> bool:
    """Whether ``data`` are summaries of this manifest's dataset (its lengths file's hash, its shards'
    counts and totals: `shardtool.format.summaries.stored_summaries`)."""
    counts = np.array([s.samples for s in manifest.shards], dtype=np.int64)
    return stored_summaries(data, manifest, counts, SUMMARIES_NAME)[0] is not None


def ensure_index(
    vd: VersionDir, info: ShardInfo, src: Origin | None, *, policy: RetryPolicy, deadline: float | None
) -> bytes:
    return ensure_small(
        vd,
        info.index,
        info.index_bytes,
        info.index_hash,
        src,
        policy=policy,
        deadline=deadline,
        what=f"sample index {info.index}",
    )


def stamp_found_intact(vd: VersionDir, shard: int, info: ShardInfo, plain: dict | None = None) -> None:
    """Trust a shard found in the cache that just hashed equal to the manifest (or, ``plain``,
    to its decompressed copy's record). It is fsynced first (a no-op for bytes already on disk,
    e.g. after a reboot), so the stamp outlives reboots."""
    fsync_path(vd.path(info.path))
    vd.write_stamp(shard, info, fsynced=True, plain=plain)


def ensure_shard(
    vd: VersionDir,
    shard: int,
    info: ShardInfo,
    src: Origin | None,
    *,
    policy: RetryPolicy,
    deadline: float | None = None,
    on_bytes=None,
    on_retry=None,
    verify: bool = False,
    durable: bool = False,
    plain: bool = False,
) -> str:
    """Make shard ``shard`` present and trusted; returns HIT, VERIFIED (found intact) or COPIED.
    ``durable``: fsync a copied shard before publishing it (see :mod:`shardtool.cache.durability`).
    ``plain``: a compressed Arrow shard is decompressed on its way in (:mod:`shardtool.cache.plain`);
    a copy already trusted in either form is kept as it is."""
    if not verify and vd.trusted(shard, info):
        return HIT
    lock_wait = None if deadline is None else max(deadline - time.monotonic(), 0.0)
    # While we wait, the holder may publish the shard and go on holding its lock as a reader:
    # trust is re-checked between tries of the lock, never waited out (a cold-cache deadlock).
    published = None if verify else (lambda: vd.trusted(shard, info))
    try:
        ctx = exclusive_unless(vd.lock_path(shard), published, timeout=lock_wait, perms=vd.perms)
        state = ctx.__enter__()
    except OSError as e:
        raise local_fault(e, f"lock of shard {info.path}") from None
    try:
        if state == DONE:
            return HIT
        if state == TIMED_OUT:
            raise CacheError(f"shard {info.path}: another process held its lock past the deadline")
        if not verify and vd.trusted(shard, info):
            return HIT  # another warmer or loader published it while we waited
        final = vd.path(info.path)
        # A killed holder of this lock may have left the shard's temp: a copy below truncates and
        # reuses it (one fixed name per shard); any other way out removes it.
        if os.path.exists(final):
            form, record = found_intact(vd, shard, info, final)
            if form is not None:
                remove_leftovers(vd, shard, final)
                stamp_found_intact(vd, shard, info, record)
                return VERIFIED
            vd.drop_stamp(shard)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(final)
        if src is None:
            remove_leftovers(vd, shard, final)
            raise NotCached(f"shard {info.path} is not in the cache {vd.root} and the source is unavailable")
        fsynced = must_fsync(durable)
        record = None
        if plain:
            # The stored bytes are verified as they land (copy_shard), then rewritten plain.
            stored = stored_copy_path(vd, shard)
            try:
                copy_shard(
                    src,
                    info,
                    stored,
                    policy=policy,
                    deadline=deadline,
                    on_bytes=on_bytes,
                    on_retry=on_retry,
                    fsync=False,
                    perms=vd.perms,
                )
                record = decompress(vd, shard, info, stored, final, fsync=fsynced)
            finally:
                remove_leftovers(vd, shard, final)
        else:
            copy_shard(
                src,
                info,
                final,
                policy=policy,
                deadline=deadline,
                on_bytes=on_bytes,
                on_retry=on_retry,
                fsync=fsynced,
                perms=vd.perms,
            )
        try:
            vd.write_stamp(shard, info, fsynced=fsynced, plain=record)
        except OSError as e:
            raise local_fault(e, f"trust stamp of shard {info.path}") from None
        return COPIED
    except OSError as e:
        if isinstance(e, (FileNotFoundError,)):
            raise
        raise local_fault(e, f"shard {info.path}") from None
    finally:
        ctx.__exit__(None, None, None)


__all__ = [
    "HIT",
    "VERIFIED",
    "COPIED",
    "FetchOptions",
    "LocalFault",
    "ensure_index",
    "ensure_lengths",
    "ensure_shard",
    "ensure_summaries",
    "ensure_small",
    "store_manifest",
    "summaries_usable",
]
