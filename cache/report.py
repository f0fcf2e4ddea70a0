"""What a warm did: counts, bytes, time, failures; as a one-line summary and as JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from .errors import EXIT_LOCAL, EXIT_OK, EXIT_REMOTE, EXIT_USAGE


@dataclass
class WarmReport:
    url: str
    cache_dir: str
    version: str | None = None
    version_dir: str | None = None
    layout: dict | None = None
    # Who reads what (None with --all): DP size, data groups, this node's groups and DP ranks,
    # and the mesh they came from; the shards warmed are those groups' ranges.
    data_layout: dict | None = None
    assigned: int = 0
    assigned_bytes: int = 0
    shards_copied: int = 0
    bytes_copied: int = 0
    shards_skipped: int = 0
    bytes_skipped: int = 0
    shards_failed: int = 0
    bytes_failed: int = 0
    not_fitted: list[int] = field(default_factory=list)
    evicted_shards: int = 0
    evicted_bytes: int = 0
    retries: int = 0
    failures: list[dict] = field(default_factory=list)  # {"shard", "path", "error", "kind"}
    warnings: list[str] = field(default_factory=list)
    error: str | None = None
    # ok | remote_failed | local_fault | usage_error (no dataset) | partial | cached (source gone or
    # unreachable; this node's cache holds every shard it reads of the version the URL last served)
    status: str = "ok"
    strict: bool = False
    durable: bool = False  # shards fsynced before publishing (else re-verified after a reboot)
    seconds: float = 0.0
    # A compressed dataset: its codec, whether its shards are decompressed into the cache (plain)
    # and the bytes they take there; bytes_copied stays the stored bytes moved from the source.
    compression: str | None = None
    decompressed: bool = False
    assigned_cache_bytes: int = 0
    cache_bytes_written: int = 0

    @property
    def gbps(self) -> float:
        return self.bytes_copied / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def exit_code(self) -> int:
        if self.status == "local_fault":
            return EXIT_LOCAL
        if self.status == "usage_error":
            return EXIT_USAGE
        if self.status == "remote_failed" and self.strict:
            return EXIT_REMOTE
        return EXIT_OK

    def to_dict(self) -> dict:
        d = asdict(self)
        d["gbps"] = round(self.gbps, 4)
        d["seconds"] = round(self.seconds, 4)
        d["exit_code"] = self.exit_code
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def summary(self) -> str:
        gb = lambda n: f"{n / 1e9:.2f} GB"  # noqa: E731
        line = (
            f"warm {self.status}: {self.assigned} shards assigned ({gb(self.assigned_bytes)}); "
            f"copied {self.shards_copied} ({gb(self.bytes_copied)}), skipped {self.shards_skipped} "
            f"({gb(self.bytes_skipped)}), failed {self.shards_failed}"
        )
        if self.compression:
            kept = (
                f"decompressed: {gb(self.assigned_cache_bytes)} plain in the cache, "
                f"{gb(self.cache_bytes_written)} written now"
                if self.decompressed
                else "kept compressed"
            )
            line += f" [{self.compression}, {kept}]"
        if self.not_fitted:
            line += f", did not fit {len(self.not_fitted)}"
        if self.evicted_shards:
            line += f", evicted {self.evicted_shards} ({gb(self.evicted_bytes)})"
        line += f" in {self.seconds:.2f}s ({self.gbps:.2f} GB/s)"
        if self.layout is None:
            line += "; every shard (--all)"
        else:
            lay = self.layout
            line += (
                f"; node {lay['node']} of {lay['num_nodes']}, {lay['ranks_per_node']} rank(s) per node "
                f"(from {lay['from']})"
            )
        if self.data_layout is not None:
            line += "; " + describe_data_layout(self.data_layout)
        return line


def data_layout_dict(data, node: int) -> dict:
    """The report's view of a `shardtool.plan.DataLayout` from node ``node``'s side."""
    groups = data.groups_on_node(node)
    dp_ranks = [d for g in groups for d in range(data.first_dp_rank(g), data.first_dp_rank(g) + data.group_sizes[g])]
    return {
        "dp_size": data.dp_size,
        "data_groups": data.num_groups,
        "node_groups": groups,
        "node_dp_ranks": dp_ranks,
        "describe": data.describe(),
        "mesh": None,
        "dp_dims": None,
    }


def _span(values: list[int]) -> str:
    if not values:
        return "none"
    if values == list(range(values[0], values[-1] + 1)):
        return str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}"
    return ",".join(map(str, values))


def describe_data_layout(d: dict) -> str:
    """ "2 data-parallel rank(s) in 1 data group(s) of 2 (mesh pp=2,dp=2, DP dim dp); this node
    reads data group 0 (DP ranks 0-1)"."""
    where = f" (mesh {d['mesh']}, DP dim {','.join(d['dp_dims'] or ['dp'])})" if d.get("mesh") else ""
    ranks = d["node_dp_ranks"]
    groups = d["node_groups"]
    return (
        f"{d['describe']}{where}; this node reads data group{'s' if len(groups) != 1 else ''} {_span(groups)} "
        f"(DP rank{'s' if len(ranks) != 1 else ''} {_span(ranks)})"
    )
