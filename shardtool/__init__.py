"""shardtool: pack raw samples into indexed shards; read them back by positioned reads.

Kept light: importing ``shardtool`` imports only the format layer. ``shardtool.pack`` is the
packing function itself, with its real signature and docstring; it loads on first use.
"""

import sys
import types

from .format import Dataset, FormatError, ShardtoolError, open_dataset

# ``shardtool.open(url)``: a dataset with len(), ds[i], slices and ds.get(key) (random access).
open = open_dataset  # noqa: A001 - the package's own name for it; builtins.open is untouched elsewhere


def __getattr__(name: str):
    if name == "__version__":
        # pyproject.toml's version, from the installed package's metadata (one source of truth),
        # read on first use: importlib.metadata costs ~0.1 s that ``import shardtool`` does not pay.
        from importlib.metadata import PackageNotFoundError, version

        try:
            value = version("shardtool")
        except PackageNotFoundError:  # a source tree on PYTHONPATH that was never installed
            value = "unknown"
        globals()["__version__"] = value
        return value
    # PEP 562: the packer (and numpy/pyarrow writers behind it) loads when first asked for.
    if name == "pack":
        from .pack.api import pack

        globals()["pack"] = pack
        return pack
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | {"pack", "__version__"})


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value) -> None:
        # Importing the subpackage makes Python set ``shardtool.pack`` to the module; keep the
        # function there (the module stays importable by name), so ``shardtool.pack`` means one
        # thing whatever was imported before.
        if name == "pack" and isinstance(value, types.ModuleType) and value.__name__ == f"{__name__}.pack":
            value = value.pack
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

__all__ = ["Dataset", "FormatError", "ShardtoolError", "open", "open_dataset", "pack", "__version__"]
