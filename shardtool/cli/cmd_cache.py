"""``shardtool cache ls|verify|gc|clear``: inspect and maintain a node-local cache directory."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping

HELP = "inspect and maintain a node-local shard cache (ls, verify, gc, clear)"
DESCRIPTION = """\
A cache directory holds one subdirectory per dataset version (named by the manifest's hash), each
a valid dataset root, and sources.json (URL -> version last warmed).

  ls      versions, their source URLs, shards cached/total and bytes
  verify  re-hash every cached shard and index; bad files are removed (exit 1 if any were bad)
  gc      remove temp files of dead writers; --unreferenced drops versions no URL points at;
          --max-bytes/--min-free evict (shards not assigned to this node first, then least
          recently used; never a shard being read)
  clear   remove all cached versions (or --version DIR); shards being read are left in place

exit codes: 0 ok, 1 verify found bad files, 2 usage.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ._args import size_arg

    p.add_argument("action", choices=["ls", "verify", "gc", "clear"])
    p.add_argument("--cache-dir", required=True, help="node-local cache directory")
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    p.add_argument("--max-bytes", type=size_arg, help="gc: evict down to this many bytes")
    p.add_argument("--min-free", type=size_arg, help="gc: evict until this much disk is free")
    p.add_argument("--unreferenced", action="store_true", help="gc: remove versions not named in sources.json")
    p.add_argument("--version", dest="version_dir", help="clear: only this version directory")
    p.add_argument("--keep-bad", action="store_true", help="verify: report bad files without removing them")


def run(args) -> int:
    from ..cache import admin

    if os.path.exists(args.cache_dir) and not os.path.isdir(args.cache_dir):
        print(f"shardtool cache: error: --cache-dir {args.cache_dir} is a file, not a cache directory", file=sys.stderr)
        return 2  # a usage error, as warm's
    res: list[dict] | Mapping[str, object]  # what --json prints: the listing, or the action's report
    failed = False
    if args.action == "ls":
        res = listing = admin.ls(args.cache_dir)
        if not args.json:
            for v in listing:
                print(
                    f"{v['dir']}  {v['cached']}/{v['shards']} shards  {v['cached_bytes'] / 1e9:.3f} GB"
                    f"  assigned {v['assigned']}  {' '.join(v['urls']) or '(no url recorded)'}"
                )
            if not listing:
                print(f"{args.cache_dir}: empty")
    elif args.action == "verify":
        res = verified = admin.verify(args.cache_dir, remove_bad=not args.keep_bad)
        failed = bool(verified["bad"] or verified["metadata_bad"])
        if not args.json:
            print(
                f"{verified['ok']} shards ok, {len(verified['bad'])} bad, {len(verified['metadata_bad'])} bad "
                f"metadata, {len(verified['busy'])} in use (skipped)"
            )
            for p in verified["bad"] + verified["metadata_bad"]:
                print(f"bad: {p}{'' if args.keep_bad else ' (removed)'}", file=sys.stderr)
    elif args.action == "gc":
        res = collected = admin.gc(
            args.cache_dir, max_bytes=args.max_bytes, min_free=args.min_free, unreferenced=args.unreferenced
        )
        if not args.json:
            print(
                f"removed {collected['temps_removed']} temp files, {len(collected['versions_removed'])} versions; "
                f"evicted {collected['evicted_shards']} shards ({collected['evicted_bytes'] / 1e9:.3f} GB)"
            )
    else:
        res = cleared = admin.clear(args.cache_dir, version_dir=args.version_dir)
        if not args.json:
            print(f"removed {len(cleared['removed'])} versions; {len(cleared['busy'])} shards in use left in place")
    if args.json:
        print(json.dumps(res, indent=1))
    if failed:
        return 1
    return 0
