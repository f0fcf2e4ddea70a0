"""The loader's errors: at the bottom of `shardtool.loader`, so every module of it can raise them."""

from __future__ import annotations

from ..format import ShardtoolError

__all__ = ["LoaderError", "LoaderStateError"]


class LoaderError(ShardtoolError, RuntimeError):
    """Loading a batch failed (a worker died, hung or raised); names the batch and its shards."""


class LoaderStateError(ShardtoolError, ValueError):
    """A state_dict that cannot be loaded here (other dataset, batching config or version)."""
