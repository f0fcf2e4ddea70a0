"""Cache errors, sorted by who is at fault, because a SLURM prolog must tell them apart.

- :class:`LocalFault`: this node's cache cannot do its job (directory missing or read-only,
  disk full, budget too small for the node's shards). The prolog exits non-zero so SLURM
  drains this node with a reason.
- :class:`RemoteError`: the source failed (unreachable, timed out, a shard missing or corrupt).
  Every node sees the same outage, so by default the warmer logs it and exits 0, and the loader
  fetches on demand later; ``--strict`` makes it fatal.
"""

from __future__ import annotations

from ..format.errors import ShardtoolError

EXIT_OK = 0
EXIT_REMOTE = 1
EXIT_USAGE = 2
EXIT_LOCAL = 3


class CacheError(ShardtoolError):
    """Base of every error the cache raises on purpose."""


class LocalFault(CacheError):
    """The node-local cache directory is unusable (permissions, read-only, full, too small)."""

    errno: int | None = None  # the OSError's, where one caused it (`cache.store.local_fault`)


class BudgetError(LocalFault):
    """This node's shards do not fit in the cache budget."""

    def __init__(self, message: str, *, needed: int, available: int):
        super().__init__(message)
        self.needed = needed
        self.available = available


class RemoteError(CacheError):
    """The source failed; ``permanent`` errors are not retried."""

    permanent = False


class SourceUnavailable(RemoteError):
    """Transient errors persisted past the retry budget or deadline."""


class SourceMissing(RemoteError):
    """The source object does not exist (404): retrying will not help."""

    permanent = True


class SourceRefused(RemoteError):
    """The source refused the request (permission denied, not a file): retrying will not help."""

    permanent = True


class SourceCorrupt(RemoteError):
    """The source object disagrees with its manifest (size or hash)."""

    permanent = True


class NotCached(CacheError):
    """A shard or dataset is not in the cache and the source cannot provide it."""


class UsageError(CacheError):
    """Bad arguments or a layout that cannot be resolved (exit code 2)."""
