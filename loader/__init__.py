"""Loading a packed dataset for multi-node training: plan (pure), read, resume.

`ShardedLoader` is imported lazily so that the pure planner (`loader.plan`, `loader.state`,
`loader.world`) can be used by the cache warmer and the CLI without importing torch.
"""
from __future__ import annotations

__all__ = ["LoaderError", "LoaderStateError", "ShardedLoader"]


def __getattr__(name: str):
    if name in __all__:
        from . import sharded

        return getattr(sharded, name)
    raise AttributeError(f"module 'loader' has no attribute {name!r}")
