"""`shardtool.loader`: the torch glue — `ShardedLoader`, its worker pool, collation.

Everything the loader decides comes from the pure planner (`shardtool.plan`); this package only
reads and delivers. `ShardedLoader` is imported lazily so that ``import shardtool.loader`` stays
cheap for code that only needs the error types.
"""

from __future__ import annotations

__all__ = ["LoaderError", "LoaderStateError", "Mixture", "MixtureSource", "ShardedLoader", "ValidSum"]


def __getattr__(name: str):
    if name in ("Mixture", "MixtureSource"):  # the config ShardedLoader(Mixture(...), steps=...) takes
        from ..plan import mixture

        return getattr(mixture, name)
    if name in ("LoaderError", "LoaderStateError"):
        from . import errors

        return getattr(errors, name)
    if name == "ValidSum":
        from .evaluate import ValidSum

        return ValidSum
    if name == "ShardedLoader":
        from .sharded import ShardedLoader

        return ShardedLoader
    raise AttributeError(f"module 'shardtool.loader' has no attribute {name!r}")
