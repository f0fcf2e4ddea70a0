"""Node-local shard cache: warm exactly this node's shards, verified and atomic; serve the loader.

Public API::

    warm(url, cache_dir, *, placement=Placement(Layout(nodes, ranks_per_node), node), all_shards=False, ...)
        -> WarmReport
    open_cache(url, cache_dir, *, storage_options=None) -> DatasetCache
        .dataset                 shardtool.format.Dataset reading metadata and shards via the cache
        .local_shard(i) -> str   path of a verified local copy (fetched on a miss, under the shard lock)
        .reading(i)              context manager: shared lock keeping eviction away; yields the path

A cache this process cannot write (warmed by root) is only read; its misses go to the user's own
cache (:mod:`cache.usercache`). What the cache writes gets :class:`Perms` (0644/0755 by default).
"""

from .assign import assigned_shards
from .cachedir import VersionDir
from .dcache import CachedDataset, DatasetCache, open_cache
from .errors import (
    EXIT_LOCAL,
    EXIT_OK,
    EXIT_REMOTE,
    EXIT_USAGE,
    BudgetError,
    CacheError,
    LocalFault,
    NotCached,
    RemoteError,
    SourceCorrupt,
    SourceMissing,
    SourceUnavailable,
    UsageError,
)
from .perms import DEFAULT_PERMS, Perms
from .report import WarmReport
from .retry import RetryPolicy
from .warmer import warm

__all__ = [
    "BudgetError",
    "CacheError",
    "CachedDataset",
    "DEFAULT_PERMS",
    "DatasetCache",
    "EXIT_LOCAL",
    "EXIT_OK",
    "EXIT_REMOTE",
    "EXIT_USAGE",
    "LocalFault",
    "NotCached",
    "Perms",
    "RemoteError",
    "RetryPolicy",
    "SourceCorrupt",
    "SourceMissing",
    "SourceUnavailable",
    "UsageError",
    "VersionDir",
    "WarmReport",
    "assigned_shards",
    "open_cache",
    "warm",
]
