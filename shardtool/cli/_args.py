"""Argument types shared by the subcommands."""

from __future__ import annotations

import argparse
import json

from ..format.errors import ShardtoolError
from ..format.sizes import SizeError, parse_size


def size_arg(text: str) -> int:
    """An argparse ``type`` for every size option: the one size grammar (`shardtool.format.sizes`)."""
    try:
        size = parse_size(text)
    except SizeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if size is None:  # parse_size gives None for None only, never for a string
        raise argparse.ArgumentTypeError(f"expected a size, found {text!r}")
    return size


def parse_storage_option(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, found {text!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def storage_options_from(args) -> dict | None:
    opts: dict = {}
    for k, v in args.storage_option or []:
        node = opts
        *parents, leaf = k.split(".")  # client_kwargs.endpoint_url=http://...
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return opts or None


def add_storage_option_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--storage-option",
        "-o",
        action="append",
        type=parse_storage_option,
        metavar="KEY=VALUE",
        help="fsspec storage option (repeatable; dotted keys nest, values parsed as JSON when possible)",
    )


def output_error(out: str, e: OSError) -> ShardtoolError:
    """Disk full, quota, permissions on a command's output: a one-line error, not a traceback.
    (Unreadable *inputs* are BadSampleErrors already; this is the output side.)"""
    where = f" ({e.filename})" if getattr(e, "filename", None) else ""
    return ShardtoolError(f"writing {out} failed: {e.strerror or e}{where}; no manifest was published")
