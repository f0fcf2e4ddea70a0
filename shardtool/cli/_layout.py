"""The data-parallel layout options shared by ``shardtool plan`` and ``shardtool warm``.

Both commands must read the same description the loader takes (``dp_size``, or a mesh and its
data-parallel dimensions), so that `plan` reports, and `warm` caches, exactly what the job's
ranks will read.
"""

from __future__ import annotations

import argparse

LAYOUT_HELP = """\
Model parallelism: --dp-size D (the (dp, mp) mesh of DDP+TP: each DP rank's model-parallel peers
are adjacent ranks), or --mesh "pp=2,dp=4,tp=2" (row-major, as torch's DeviceMesh lays it out)
with --dp-dim dp (several: --dp-dim rep,shard for HSDP). Data groups then follow the nodes
hosting each DP rank's peers; without either, every rank is its own DP rank. --nodes-per-group K
joins the groups of every K consecutive nodes: each of them caches the group's whole range (K times
the disk), and a cost model balances steps across all its ranks (ShardedLoader's nodes_per_group)."""


def add_layout_arguments(group) -> None:
    """--dp-size, --mesh, --dp-dim on ``group`` (a parser or an argument group)."""
    group.add_argument(
        "--dp-size",
        type=int,
        default=None,
        metavar="D",
        help="data-parallel size when each DP rank has model-parallel peers (default: every rank)",
    )
    group.add_argument(
        "--mesh",
        default=None,
        metavar="SPEC",
        help='device mesh, row-major like torch\'s DeviceMesh, e.g. "pp=2,dp=4,tp=2"',
    )
    group.add_argument(
        "--dp-dim",
        default="dp",
        metavar="NAMES",
        help="the mesh's data-parallel dimension(s), comma-separated (default dp)",
    )
    group.add_argument(
        "--nodes-per-group",
        type=int,
        default=1,
        metavar="K",
        help="nodes that read one range together, each caching all of it (default 1: a node reads its own)",
    )


def dp_dims(args: argparse.Namespace) -> tuple[str, ...]:
    return tuple(d.strip() for d in args.dp_dim.split(",") if d.strip())


def parsed_mesh(args: argparse.Namespace):
    """The `shardtool.plan.Mesh` of --mesh, or None. LayoutError on a malformed spec."""
    from ..plan import parse_mesh

    return parse_mesh(args.mesh) if args.mesh else None


def data_layout_of(args: argparse.Namespace, placement):
    """(DataLayout, DP rank or None) of ``placement`` under --dp-size / --mesh / --dp-dim.

    ``placement`` may be a whole node (rank None, the warmer): the data layout does not depend
    on which rank asks. LayoutError (a ValueError) when the description does not fit the layout.
    """
    from ..plan import Placement, data_parallel

    rank = placement.rank
    asking = placement if rank is not None else Placement(placement.layout, 0, 0, placement.source)
    data, dp_rank = data_parallel(
        asking,
        dp_size=args.dp_size,
        mesh=parsed_mesh(args),
        dp_dims=dp_dims(args),
        nodes_per_group=getattr(args, "nodes_per_group", 1),
    )
    return data, (dp_rank if rank is not None else None)


def describe_layout(args: argparse.Namespace) -> dict:
    """The description as the JSON reports carry it (the mesh normalised: "pp=2,dp=2")."""
    mesh = parsed_mesh(args)
    described = {"mesh": mesh.describe() if mesh is not None else None, "dp_dims": list(dp_dims(args))}
    return {**described, "nodes_per_group": getattr(args, "nodes_per_group", 1)}
