"""Packing: sources → units → workers → shards → manifest (or job-array fragments → merge).

Importing this subpackage rebinds ``shardtool.pack`` from the function to this module (Python
sets a package attribute for each imported submodule), so the module itself is made callable:
``shardtool.pack(...)`` packs either way.
"""

import sys
import types

from .api import PackResult, pack
from .merge import merge


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return pack(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

__all__ = ["PackResult", "merge", "pack"]
