"""The ``shardtool`` command: a thin layer, one module per subcommand.

Each ``cmd_<name>.py`` module defines ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``. Subcommands that need ``cache`` or ``loader`` import them inside ``run``,
so ``shardtool --help`` stays fast and the format package never imports them at module level.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from ..format.errors import ShardtoolError

COMMANDS = ["pack", "merge", "inspect", "verify", "upgrade", "plan", "warm", "cache", "bench", "stats"]


def _load(name: str):
    try:
        return importlib.import_module(f"{__name__}.cmd_{name}")
    except ModuleNotFoundError as e:
        if e.name == f"{__name__}.cmd_{name}":
            return None
        raise


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="shardtool",
        description="Pack raw samples into indexed shards, warm node-local caches, and plan/benchmark loading.",
    )
    parser.add_argument("--version", action="version", version=f"shardtool {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        mod = _load(name)
        if mod is None:
            continue
        p = sub.add_parser(name, help=mod.HELP, description=getattr(mod, "DESCRIPTION", mod.HELP),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except ShardtoolError as e:
        print(f"shardtool {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"shardtool {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
