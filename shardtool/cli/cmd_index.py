"""shardtool index TARS... -o DATASET"""

from __future__ import annotations

import json
import sys

from ._args import output_error, size_arg

HELP = "index existing WebDataset tars in place (no copy): manifest, sample indexes and lengths only"
DESCRIPTION = """\
Make a dataset of WebDataset tars without rewriting them. DATASET gets the manifest, one
sample index per tar, lengths.npy and summaries; the tars stay where they are (a local or
parallel filesystem, or an object store: s3://…, gs://…, https://…), named in the manifest by
their path relative to DATASET (../tars/000000.tar) or their URL, with their whole-file hash.
Every loader, warm, plan and verify feature then works on DATASET; a tar changed after
indexing is refused by its hash at warm and at read (re-run index after changing tars).

Each tar is read once: its headers for the sample index (keys as pack makes them:
dir/stem.ext -> dir__stem), and all of it for the hash. The rules of packing a tar apply: no
links or special files, no absolute or '..' member names, no member over --max-member-bytes,
the same fields in every sample. A tar that breaks them is an error naming it and the member;
--skip-bad leaves it out and lists it. Nothing is published until every tar is indexed.

Lengths: --length-field FIELD as pack's --length (txt: characters, npy: elements, cls: its
value, json: len of the object), or FIELD:KEY for one key of a JSON member (json:num_tokens),
or --length-fn MODULE:FUNCTION of the sample dict (fields as bytes); default: payload bytes.

Job arrays: --num-tasks T --task-index I (defaults from SLURM_ARRAY_TASK_COUNT / _ID) index
disjoint slices of TARS; then `shardtool merge DATASET`.

Examples:
  shardtool index /lustre/laion/{00000..04999}.tar -o /lustre/laion-ds --workers 16
  shardtool index /lustre/laion/ -o laion-ds --length-field json:num_tokens --workers 16
  shardtool index 's3://bucket/tars/*.tar' -o ds       (URLs are listed one by one, not globbed)
"""


def add_arguments(p) -> None:
    p.add_argument("tars", nargs="+", metavar="TAR", help="tar files, directories (their *.tar), globs or URLs")
    p.add_argument("-o", "--out", required=True, metavar="DATASET", help="dataset directory to write")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--length-field", metavar="FIELD[:KEY]", help="sample length from a field (see above)")
    g.add_argument("--length-fn", metavar="MODULE:FUNCTION", help="sample length = FUNCTION(sample dict)")
    p.add_argument("--workers", type=int, default=1, metavar="N", help="worker processes (default 1)")
    p.add_argument("--num-tasks", type=int, metavar="T", help="job-array size (default: $SLURM_ARRAY_TASK_COUNT or 1)")
    p.add_argument(
        "--task-index", type=int, metavar="I", help="this task, 0..T-1 (default: its place in the SLURM array)"
    )
    p.add_argument("--skip-bad", action="store_true", help="leave out tars that break the rules, listing them")
    p.add_argument(
        "--max-member-bytes", metavar="SIZE", type=size_arg, help="refuse members larger than this (default 256MiB)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset in DATASET")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args) -> int:
    from ..pack.inplace import index_tars

    try:
        result = index_tars(
            args.tars,
            args.out,
            length=args.length_field,
            length_fn=args.length_fn,
            workers=args.workers,
            skip_bad=args.skip_bad,
            overwrite=args.overwrite,
            max_member_bytes=args.max_member_bytes,
            num_tasks=args.num_tasks,
            task_index=args.task_index,
        )
    except OSError as e:
        raise output_error(args.out, e) from None
    if args.json:
        print(json.dumps(result.to_dict(), indent=1))
    else:
        for s in result.skipped:
            print(f"skipped: {s}", file=sys.stderr)
        print(result.summary())
    return 0
