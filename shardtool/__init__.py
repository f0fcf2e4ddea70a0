"""shardtool: pack raw samples into indexed shards; read them back by positioned reads.

Kept light: importing ``shardtool`` imports only the format layer; ``pack`` loads on first use.
"""
from .format import Dataset, FormatError, ShardtoolError, open_dataset

__version__ = "0.1.0"


def pack(*args, **kwargs):
    """Pack sources into a dataset; see :func:`shardtool.pack.api.pack`."""
    from .pack.api import pack as _pack

    return _pack(*args, **kwargs)


__all__ = ["Dataset", "FormatError", "ShardtoolError", "open_dataset", "pack", "__version__"]
