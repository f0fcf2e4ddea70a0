"""Parsing and checking of pack options (length functions, paths, which options go together).

Sizes follow the one size grammar (`shardtool.format.sizes`); job-array slices come from the one
environment reader (`shardtool.plan.env.array_task`).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable

from ..format.errors import ShardtoolError
from ..format.manifest import COMPRESSIONS
from .tokenize import TOKENS_FIELD


def strip_file_scheme(path: str) -> str:
    """``file:///data/x`` → ``/data/x``; any other path or URL is returned unchanged."""
    return path[len("file://") :] if path.startswith("file://") else path


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
        raise ShardtoolError(
            f"--length-fn {spec!r}: cannot import {mod_name!r} ({e}; looked in sys.path and "
            f"{os.path.abspath(search_dir or os.getcwd())})"
        ) from None
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


def check_options(
    format: str,
    length: str | None,
    length_fn: str | None,
    workers: int,
    compression: str | None,
    tokenizer,
    text_field: str | None,
    chat_field: str | None = None,
    chat_template: str | None = None,
    image_field: str | None = None,
    interleaved_field: str | None = None,
) -> str | None:
    """Refuse inconsistent options before anything is read; returns the compression (or None)."""
    if format not in ("tar", "arrow"):
        raise ShardtoolError(f"--format must be tar or arrow, got {format!r}")
    if length is not None and length_fn is not None:
        raise ShardtoolError("give --length or --length-fn, not both")
    if length_fn is not None:
        load_function(length_fn)  # fail early, in the parent, with a clear message
    if workers < 1:
        raise ShardtoolError(f"--workers must be ≥ 1, got {workers}")
    if compression in (None, "none"):
        compression = None
    elif compression not in COMPRESSIONS:
        raise ShardtoolError(f"--compression must be one of {', '.join(COMPRESSIONS)} or none, got {compression!r}")
    elif format != "arrow":
        raise ShardtoolError(
            "--compression applies to Arrow shards (--format arrow): tar shards stay plain "
            "WebDataset tars, which webdataset and tar read unmodified"
        )
    if text_field is not None and chat_field is not None:
        raise ShardtoolError("give --text-field (plain text) or --chat-field (conversations), not both")
    if chat_template is not None and chat_field is None:
        raise ShardtoolError("--chat-template renders the conversations of --chat-field; give --chat-field")
    if sum(f is not None for f in (text_field, chat_field, interleaved_field)) > 1:
        raise ShardtoolError("give one of --text-field, --chat-field and --interleaved-field")
    if (tokenizer is None) != all(f is None for f in (text_field, chat_field, interleaved_field, image_field)):
        raise ShardtoolError(
            "--tokenizer and --text-field (or --chat-field) go together (the text field is what gets tokenized)"
        )
    if tokenizer is not None and (length_fn is not None or length not in (None, TOKENS_FIELD)):
        raise ShardtoolError(
            f"with --tokenizer the length is the token count (field {TOKENS_FIELD!r}); drop --length/--length-fn"
        )
    return compression
