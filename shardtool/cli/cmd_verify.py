"""shardtool verify URL"""

from __future__ import annotations

import json
import sys

from ._args import add_storage_option_argument, storage_options_from

HELP = "rehash every shard and check every index entry; exit 1 naming each bad shard"
DESCRIPTION = """\
Check a dataset against its manifest: each shard's size and content hash, each sample
index's hash, and every index entry against the bytes (tar member headers) or rows (Arrow)
of its shard. Exits 0 if all is well, 1 listing every bad shard.
"""


def add_arguments(p) -> None:
    p.add_argument("url", metavar="URL", help="dataset directory or fsspec URL")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    add_storage_option_argument(p)


def run(args) -> int:
    from ..format.dataset import open_dataset
    from ..pack.progress import Progress
    from ..pack.verify import verify

    opts = storage_options_from(args)
    with open_dataset(args.url, storage_options=opts) as ds:  # opened once: the bar's total, then the check itself
        bar = Progress(total=ds.num_shards, quiet=args.quiet or args.json, desc="verify")
        try:
            report = verify(args.url, storage_options=opts, progress=lambda k: bar.update(k, 0), dataset=ds)
        finally:
            bar.close()
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for b in report["bad"]:
            print(f"BAD {b['shard']}: {b['error']}", file=sys.stderr)
        status = "OK" if report["ok"] else f"{len(report['bad'])} bad"
        print(
            f"verify {args.url}: {status} ({report['shards']} shards, {report['samples']} samples, "
            f"{report['bytes'] / 1e6:.1f} MB)"
        )
    return 0 if report["ok"] else 1
