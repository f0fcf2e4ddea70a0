"""``shardtool upgrade DATASET``: bring a dataset packed by an older shardtool up to this one's format."""

from __future__ import annotations

import json
import sys

from ._args import add_storage_option_argument, storage_options_from

HELP = "store the per-shard summaries a dataset packed by shardtool < 0.2 lacks (index.json unchanged)"
DESCRIPTION = """\
A dataset packed before per-shard summaries existed (no summaries.arrow beside index.json, or one
that no longer matches its lengths) still loads, but every training rank then reads every
sample's length to compute them, with a SummariesMissing warning: at 10^9 samples that is 8 GB
read and seconds of work on each of thousands of ranks, at start-up.

This command computes the summaries once from lengths.npy (checked against the manifest's hash)
and writes summaries.arrow: atomically on a local or parallel filesystem (temp file, fsync,
rename), as one object PUT on an object store. It reads the file back before it reports success.
index.json is not changed, so the dataset version stays the same: node caches warmed before
and saved loader states (state_dict) stay valid. Running it again does nothing.

Run it once, from any machine that can write the dataset, before the next job; caches warmed
from the old dataset fetch summaries.arrow at the next warm.

exit codes: 0 up to date or upgraded; 1 --check found an upgrade needed, or the dataset is unreadable.

examples:
  shardtool upgrade /lustre/datasets/web-v2 --check
  shardtool upgrade s3://bucket/datasets/web-v2
"""


def add_arguments(p) -> None:
    p.add_argument("url", metavar="DATASET", help="dataset root: local path or fsspec URL (s3://, gs://, ...)")
    p.add_argument(
        "--check",
        action="store_true",
        help="only report whether the dataset needs an upgrade (exit 1 if it does); write nothing",
    )
    add_storage_option_argument(p)
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")


def run(args) -> int:
    from ..format.upgrade import upgrade_dataset

    report = upgrade_dataset(args.url, storage_options=storage_options_from(args), check=args.check)
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print(f"shardtool upgrade: {report.summary()}", file=sys.stderr if args.check and report.needed else sys.stdout)
    return 1 if args.check and report.needed else 0
