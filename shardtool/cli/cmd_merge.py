"""shardtool merge OUT"""

from __future__ import annotations

import json

HELP = "write the single manifest of a dataset packed by a job array (--num-tasks)"
DESCRIPTION = """\
Combine the task fragments in OUT/tasks/ into OUT/index.json. Fails, naming them, if any
task has not finished, and if sample keys collide across tasks.
"""


def add_arguments(p) -> None:
    p.add_argument("out", metavar="OUT", help="dataset directory the tasks packed into")
    p.add_argument(
        "--num-tasks",
        type=int,
        metavar="T",
        help="job-array size (needed only if OUT holds fragments of several arrays)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args) -> int:
    from ..pack.merge import merge

    r = merge(args.out, num_tasks=args.num_tasks)
    if args.json:
        print(json.dumps(r, indent=1))
    else:
        capped = (
            f"dropped {r['dropped']} and truncated {r['truncated']} over --max-length; "
            if r["dropped"] or r["truncated"]
            else ""
        )
        print(
            f"merged {r['tasks']} tasks: {r['samples']} samples in {r['shards']} shards "
            f"({r['bytes'] / 1e6:.1f} MB); skipped {len(r['skipped'])}; {capped}manifest at {r['out']}/index.json"
        )
    return 0
