"""The ``shardtool`` command: a thin layer, one module per subcommand.

Each ``cmd_<name>.py`` module defines ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``. Subcommands that need ``cache`` or ``loader`` import them inside ``run``,
so ``shardtool --help`` stays fast and the format package never imports them at module level.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from ..format.errors import ShardtoolError

COMMANDS = [
    "pack",
    "index",
    "merge",
    "inspect",
    "verify",
    "upgrade",
    "plan",
    "trace",
    "state",
    "warm",
    "prolog",
    "cache",
    "bench",
    "stats",
]


def _load(name: str):
    try:
        return importlib.import_module(f"{__name__}.cmd_{name}")
    except ModuleNotFoundError as e:
        if e.name == f"{__name__}.cmd_{name}":
            return None
        raise


class _Version(argparse.Action):
    """``--version``: the installed package's version, looked up only when asked (the metadata
    lookup costs ~0.1 s that no other command should pay)."""

    def __call__(self, parser, namespace, values, option_string=None):
        from .. import __version__

        sys.stdout.write(f"shardtool {__version__}\n")  # stdout, as argparse's own version action
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardtool",
        description="Pack raw samples into indexed shards, warm node-local caches, and plan/benchmark loading.",
    )
    parser.add_argument("--version", action=_Version, nargs=0, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        mod = _load(name)
        if mod is None:
            continue
        p = sub.add_parser(
            name,
            help=mod.HELP,
            description=getattr(mod, "DESCRIPTION", mod.HELP),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        mod.add_arguments(p)
        p.set_defaults(command_run=mod.run)
    return parser


# What a command killed by SIGPIPE exits with in a shell (128 + 13): `set -o pipefail` sees it.
EXIT_BROKEN_PIPE = 141


def main(argv: list[str] | None = None) -> int:
    """Run one command. Its reader closing the pipe (`shardtool inspect DS | head`) ends it
    quietly with 141, as a command killed by SIGPIPE would, for every command in this one place."""
    try:
        try:
            return _main(argv)
        finally:
            # Flushed here so a closed pipe raises inside the try, not at interpreter exit.
            sys.stdout.flush()
    except BrokenPipeError:
        # Python's documented recipe (library/signal, "Note on SIGPIPE"): point stdout at devnull
        # so the interpreter's own flush at exit cannot raise (and print) the error a second time.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command_run", None):
        parser.print_help()
        return 2
    try:
        return int(args.command_run(args) or 0)
    except ShardtoolError as e:
        print(f"shardtool {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"shardtool {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
