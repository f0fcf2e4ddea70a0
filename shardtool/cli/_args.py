"""Argument types shared by the subcommands."""
from __future__ import annotations

import argparse

from ..format.sizes import SizeError, parse_size


def size_arg(text: str) -> int:
    """An argparse ``type`` for every size option: the one size grammar (`shardtool.format.sizes`)."""
    try:
        return parse_size(text)
    except SizeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
