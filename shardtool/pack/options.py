"""Parsing of pack options that come as strings (sizes, task slices, length functions, paths).

Pure functions: the environment is an argument, so precedence (explicit > environment >
default) is testable without touching ``os.environ``.
"""
from __future__ import annotations

import importlib
import os
import re
import sys
from typing import Callable, Mapping

from ..format.errors import ShardtoolError

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(text: str | int | None) -> int | None:
    """``"1GiB"`` → 1073741824, ``"500MB"`` → 500000000, ``123`` → 123."""
    if text is None or isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ShardtoolError(f"cannot read size {text!r} (examples: 1GiB, 500MB, 262144)")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise ShardtoolError(f"size {text!r} must be positive")
    return value


def strip_file_scheme(path: str) -> str:
    """``file:///data/x`` → ``/data/x``; any other path or URL is returned unchanged."""
    return path[len("file://"):] if path.startswith("file://") else path


def resolve_tasks(num_tasks: int | None, task_index: int | None, env: Mapping[str, str]) -> tuple[int, int]:
    """(T, I) for a job-array slice: explicit arguments, else SLURM_ARRAY_*, else (1, 0).

    SLURM numbers array tasks from ``SLURM_ARRAY_TASK_MIN`` (usually 0 or 1); the index is taken
    relative to it so ``--array=1-8`` works as well as ``--array=0-7``.
    """
    if num_tasks is None and env.get("SLURM_ARRAY_TASK_COUNT"):
        num_tasks = int(env["SLURM_ARRAY_TASK_COUNT"])
    if task_index is None and env.get("SLURM_ARRAY_TASK_ID") and num_tasks is not None and num_tasks > 1:
        task_index = int(env["SLURM_ARRAY_TASK_ID"]) - int(env.get("SLURM_ARRAY_TASK_MIN") or 0)
    num_tasks = 1 if num_tasks is None else int(num_tasks)
    task_index = 0 if task_index is None else int(task_index)
    if num_tasks < 1:
        raise ShardtoolError(f"--num-tasks must be ≥ 1, got {num_tasks}")
    if not 0 <= task_index < num_tasks:
        raise ShardtoolError(f"--task-index {task_index} is outside 0..{num_tasks - 1}")
    return num_tasks, task_index


def load_function(spec: str, *, search_dir: str | None = None) -> Callable:
    """Import ``module:function`` (used for --length-fn, in the parent and in every worker).

    A module not importable from ``sys.path`` is looked for in ``search_dir`` (default: the
    current directory), as ``python -m`` would find it but the ``shardtool`` command would not.
    That directory is appended to ``sys.path``, so an installed module of the same name wins.
    """
    mod_name, sep, fn_name = spec.partition(":")
    if not sep or not mod_name or not fn_name:
        raise ShardtoolError(f"--length-fn {spec!r} must look like module:function")
    try:
        obj = _import_here_too(mod_name, os.path.abspath(search_dir or os.getcwd()))
    except ImportError as e:
        raise ShardtoolError(f"--length-fn {spec!r}: cannot import {mod_name!r} ({e}; looked in sys.path and "
                             f"{os.path.abspath(search_dir or os.getcwd())})") from None
    for part in fn_name.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ShardtoolError(f"--length-fn {spec!r}: {mod_name!r} has no {fn_name!r}")
    if not callable(obj):
        raise ShardtoolError(f"--length-fn {spec!r} is not callable")
    return obj


def _import_here_too(mod_name: str, directory: str):
    try:
        return importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        on_path = {os.path.abspath(p or os.curdir) for p in sys.path if isinstance(p, str)}
        if e.name != mod_name.split(".")[0] or directory in on_path:
            raise
    sys.path.append(directory)
    importlib.invalidate_caches()
    return importlib.import_module(mod_name)
