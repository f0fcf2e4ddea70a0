"""Parsing of pack options that come as strings (length functions, paths).

Sizes follow the one size grammar (`shardtool.format.sizes`); job-array slices come from the one
environment reader (`shardtool.plan.env.array_task`).
"""
from __future__ import annotations

import importlib
from typing import Callable

from ..format.errors import ShardtoolError


def strip_file_scheme(path: str) -> str:
    """``file:///data/x`` → ``/data/x``; any other path or URL is returned unchanged."""
    return path[len("file://"):] if path.startswith("file://") else path


def load_function(spec: str) -> Callable:
    """Import ``module:function`` (used for --length-fn, in the parent and in every worker)."""
    mod_name, sep, fn_name = spec.partition(":")
    if not sep or not mod_name or not fn_name:
        raise ShardtoolError(f"--length-fn {spec!r} must look like module:function")
    try:
        obj = importlib.import_module(mod_name)
    except ImportError as e:
        raise ShardtoolError(f"--length-fn {spec!r}: cannot import {mod_name!r} ({e})") from None
    for part in fn_name.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ShardtoolError(f"--length-fn {spec!r}: {mod_name!r} has no {fn_name!r}")
    if not callable(obj):
        raise ShardtoolError(f"--length-fn {spec!r} is not callable")
    return obj
