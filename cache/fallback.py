"""A node whose cache holds a complete version for a URL serves it when the source is gone.

The warmer records which version each URL served (``sources.json``) and keeps that version's
manifest, summaries, lengths and sample indexes beside its shards, so the version directory is a
dataset root of its own. When the source later has no manifest (moved away, deleted) or cannot be
reached, a warm that finds every shard this node reads already trusted there succeeds with a
warning (status ``cached``), and the loader opens the same version offline
(:func:`shardtool.cache.open_cache`).
"""

from __future__ import annotations

import warnings

from ..format.dataset import Dataset, SummariesMissing
from ..format.errors import FormatError
from ..format.manifest import lengths_from_bytes, manifest_hash
from .assign import assigned_shards
from .cachedir import VersionDir, recorded_version
from .errors import CacheError
from .meta import FetchOptions, ensure_index, ensure_lengths, ensure_summaries
from .perms import DEFAULT_PERMS, Perms
from .retry import RetryPolicy

_OFFLINE: FetchOptions = {"policy": RetryPolicy(attempts=1), "deadline": None}


def complete_cached_version(
    url: str, cache_dir: str, placement, data_layout, *, perms: Perms = DEFAULT_PERMS
) -> tuple[VersionDir, list[int], int] | None:
    """(version dir, this node's shards, their bytes) when the version recorded for ``url`` holds
    every shard (and sample index) ``placement`` reads, all trusted; None otherwise."""
    version = recorded_version(cache_dir, url)
    if version is None:
        return None
    vd = VersionDir(cache_dir, version, perms)
    try:
        with open(vd.manifest_path, "rb") as f:
            manifest_bytes = f.read()
        if manifest_hash(manifest_bytes) != version:
            return None
        ds = Dataset(vd.root, manifest_bytes=manifest_bytes)
        m = ds.manifest
        summaries_bytes = ensure_summaries(vd, None, **_OFFLINE)
        if summaries_bytes is None:
            ds.use_lengths(
                lengths_from_bytes(ensure_lengths(vd, m, None, **_OFFLINE), expected=m.num_samples, source=vd.root)
            )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SummariesMissing)
            summaries = ds.load_summaries(summaries_bytes)
        shards = assigned_shards(summaries, placement, data_layout)
        for i in shards:
            if not vd.trusted(i, m.shards[i]):
                return None
            ensure_index(vd, m.shards[i], None, **_OFFLINE)
    except (OSError, ValueError, CacheError, FormatError):
        return None
    return vd, shards, sum(m.shards[i].bytes for i in shards)


__all__ = ["complete_cached_version"]
