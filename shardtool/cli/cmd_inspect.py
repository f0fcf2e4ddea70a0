"""shardtool inspect URL"""

from __future__ import annotations

import json

from ._args import add_storage_option_argument, storage_options_from

HELP = "show a dataset's counts, bytes, fields, length summary and one sample"
DESCRIPTION = """\
Read a dataset's manifest (local path, file://, s3://, any fsspec URL) and print what it
holds: samples, shards, bytes, fields and their encodings, the length definition and its
summary (count/total/min/p50/p90/p99/max), and a peek at the first sample.
"""


def add_arguments(p) -> None:
    p.add_argument("url", metavar="URL", help="dataset directory or fsspec URL")
    p.add_argument("--no-peek", action="store_true", help="do not read a sample")
    p.add_argument("--json", action="store_true", help="print as JSON")
    add_storage_option_argument(p)


def run(args) -> int:
    from ..pack.inspection import inspect, render

    info = inspect(args.url, storage_options=storage_options_from(args), peek=not args.no_peek)
    print(json.dumps(info, indent=1, default=str) if args.json else render(info))
    return 0
