"""shardtool pack SRC... -o OUT"""
from __future__ import annotations

import json
import sys

from ._args import size_arg

HELP = "pack files, JSONL, Parquet/Arrow or WebDataset tars into indexed shards"
DESCRIPTION = """\
Pack raw samples into an indexed dataset (index.json + shards/ + per-shard sample index).

Sources (any mix):
  DIR                     files grouped into samples by basename, WebDataset style:
                          0001.jpg + 0001.json -> one sample with fields jpg, json
  *.jsonl[.gz|.zst]       one sample per line (a JSON object; its keys are the fields)
  *.parquet, *.arrow      one sample per row (columns are the fields)
  *.tar[.gz]              existing WebDataset shards, re-sharded and indexed

Job arrays: with --num-tasks T --task-index I (defaults from SLURM_ARRAY_TASK_COUNT /
SLURM_ARRAY_TASK_ID) each task packs a disjoint slice; then `shardtool merge OUT`.

Examples:
  shardtool pack corpus.parquet -o ds --length tokens --shard-size 512MiB --workers 8
  shardtool pack images/ -o ds --samples-per-shard 10000
"""


def add_arguments(p) -> None:
    p.add_argument("sources", nargs="+", metavar="SRC", help="input files, directories or glob patterns")
    p.add_argument("-o", "--out", required=True, metavar="OUT", help="output dataset directory")
    p.add_argument("--format", choices=["tar", "arrow"], default="tar", help="shard format (default: tar)")
    p.add_argument("--key", metavar="FIELD", help="take sample keys from FIELD (JSONL/Parquet/Arrow); "
                   "default: the running position, zero-padded")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--length", metavar="FIELD", help="sample length = len(FIELD), or its value if an integer "
                   "(default: payload bytes)")
    g.add_argument("--length-fn", metavar="MODULE:FUNCTION", help="sample length = FUNCTION(sample dict)")
    p.add_argument("--shard-size", metavar="SIZE", type=size_arg, help="target shard size, e.g. 1GiB (default 256MiB unless "
                   "--samples-per-shard is given)")
    p.add_argument("--samples-per-shard", type=int, metavar="N", help="at most N samples per shard")
    p.add_argument("--workers", type=int, default=1, metavar="N", help="worker processes (default 1)")
    p.add_argument("--num-tasks", type=int, metavar="T", help="job-array size (default: $SLURM_ARRAY_TASK_COUNT or 1)")
    p.add_argument("--task-index", type=int, metavar="I", help="this task (default: $SLURM_ARRAY_TASK_ID)")
    p.add_argument("--skip-bad", action="store_true", help="skip bad samples/sources, counting and listing them")
    p.add_argument("--max-sample-bytes", metavar="SIZE", type=size_arg, help="refuse lines/members larger than this "
                   "(default 256MiB; bounds memory on corrupt or compressed-bomb input)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset in OUT")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args) -> int:
    from ..format.errors import ShardtoolError
    from ..pack.api import pack

    try:
        result = pack(args.sources, args.out, format=args.format, key=args.key, length=args.length,
                      length_fn=args.length_fn, shard_size=args.shard_size, samples_per_shard=args.samples_per_shard,
                      workers=args.workers, num_tasks=args.num_tasks, task_index=args.task_index,
                      skip_bad=args.skip_bad, overwrite=args.overwrite, quiet=args.quiet or args.json,
                      max_sample_bytes=args.max_sample_bytes)
    except OSError as e:
        # Disk full, quota, permissions on OUT: a one-line error, not a traceback. (Unreadable
        # *inputs* are BadSampleErrors already; this is the output side.)
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        raise ShardtoolError(f"writing {args.out} failed: {e.strerror or e}{where}; no manifest was published") from None
    if args.json:
        print(json.dumps(result.to_dict(), indent=1))
        return 0
    for s in result.skipped[:50]:
        print(f"skipped: {s}", file=sys.stderr)
    if len(result.skipped) > 50:
        print(f"skipped: … and {len(result.skipped) - 50} more", file=sys.stderr)
    print(result.summary())
    return 0
