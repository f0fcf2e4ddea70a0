"""Packing: sources → units → workers → shards → manifest (or job-array fragments → merge)."""
from .api import PackResult, pack
from .merge import merge

__all__ = ["PackResult", "merge", "pack"]
