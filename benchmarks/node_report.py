"""The per-node benchmark's results: one rank's counts, the node's row, the median of rounds, the table.

Apart from `node` (which runs the ranks) so that how a number is summarised and printed can be
read, and changed, without the readers and process plumbing around it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np


@dataclass
class RankResult:
    reader: str
    rank: int
    num_workers: int
    batches: int = 0
    samples: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    bytes: int = 0
    first_batch_s: float = 0.0
    wall_s: float = 0.0
    wait_s: float = 0.0
    peak_rss_mb: float = 0.0
    error: str | None = None
    steady: float | None = None  # the loader's own steady-state window, when it reports one
    loader: dict | None = None  # shardtool's loader.metrics() over the steady state (plain dicts)

    @property
    def steady_s(self) -> float:
        return max(self.steady if self.steady is not None else self.wall_s - self.first_batch_s, 1e-9)

    def use_loader_metrics(self, m: dict) -> None:
        """Counts, wait and steady time as the loader measured them (its window after the first batch)."""
        w = m["window"]
        self.loader = m
        self.samples, self.tokens, self.padded_tokens = w["samples"], w["tokens"], w["padded_tokens"]
        self.wait_s, self.steady = w["wait_s"], w["seconds"]


def summarize(results: list[RankResult]) -> dict:
    wall = max(r.wall_s for r in results)
    steady = max(r.steady_s for r in results)
    samples = sum(r.samples for r in results)
    tokens = sum(r.tokens for r in results)
    nbytes = sum(r.bytes for r in results)
    padded = sum(r.padded_tokens for r in results)
    waits = [r.wait_s / r.steady_s for r in results]
    loader = merge_loader_metrics([r.loader["window"] for r in results if r.loader], steady)
    return {
        "reader": results[0].reader,
        "ranks": len(results),
        "num_workers": results[0].num_workers,
        "batches_per_rank": [r.batches for r in results],
        "samples_per_s": samples / steady,
        "tokens_per_s": tokens / steady,
        "mb_per_s": nbytes / steady / 1e6,
        "first_batch_s": max(r.first_batch_s for r in results),
        "padding_efficiency": tokens / padded if padded else None,
        "wait_fraction": float(np.mean(waits)),
        "wall_s": wall,
        "peak_rss_mb": max(r.peak_rss_mb for r in results),
        "errors": [r.error for r in results if r.error],
        # Read from the loader (shardtool only): bytes read from storage, cache hits, open latency.
        "read_mb_per_s": loader["read_mb_per_s"] if loader else None,
        "cache_hit_rate": loader["cache"]["hit_rate"] if loader else None,
        "shard_open_p99_ms": 1000 * loader["shard_open_p99_s"] if loader and loader["shard_open_p99_s"] else None,
        "loader": loader,
        "loader_per_rank": [r.loader for r in results if r.loader] or None,
    }


# The numbers of a `summarize` row that vary from round to round (the rest is configuration).
MEASURED = (
    "samples_per_s",
    "tokens_per_s",
    "mb_per_s",
    "first_batch_s",
    "padding_efficiency",
    "wait_fraction",
    "wall_s",
    "peak_rss_mb",
    "read_mb_per_s",
    "cache_hit_rate",
    "shard_open_p99_ms",
)


def median_row(rows: list[dict]) -> dict:
    """One reader's rounds (``summarize`` rows) as one: the median of every number, the data-wait
    fraction's and samples/s' min-max, every round's errors. One round: that row as it is."""
    if len(rows) == 1:
        return rows[0]
    out = dict(rows[len(rows) // 2])
    for k in MEASURED:
        vals = [r[k] for r in rows]
        if all(isinstance(x, (int, float)) for x in vals):
            out[k] = float(np.median(vals))
    out["wait_fraction_range"] = [min(r["wait_fraction"] for r in rows), max(r["wait_fraction"] for r in rows)]
    out["samples_per_s_range"] = [min(r["samples_per_s"] for r in rows), max(r["samples_per_s"] for r in rows)]
    out["errors"] = [e for r in rows for e in r["errors"]]
    out["rounds"] = [{k: r[k] for k in ("samples_per_s", "wait_fraction", "first_batch_s")} for r in rows]
    return out


def merge_loader_metrics(windows: list[dict], steady: float) -> dict | None:
    """The node's view of the ranks' loader metrics: counters added, rates over the node's time."""
    if not windows:
        return None
    add = lambda f: sum(f(w) for w in windows)  # noqa: E731
    hits, misses = add(lambda w: w["cache"]["hits"]), add(lambda w: w["cache"]["misses"])
    read = {t: add(lambda w, t=t: w["bytes_read"][t]) for t in ("cache", "local", "remote")}
    p99 = [w["shard_open_p99_s"] for w in windows if w["shard_open_p99_s"] is not None]
    return {
        "wait_fraction_per_rank": [w["wait_fraction"] for w in windows],
        "produce_s": add(lambda w: w["produce_s"]),
        "bytes_read": read,
        "read_mb_per_s": sum(read.values()) / steady / 1e6,
        "cache": {
            "hits": hits,
            "misses": misses,
            "hit_rate": hits / (hits + misses) if hits + misses else None,
            "fetch_bytes": add(lambda w: w["cache"]["fetch_bytes"]),
        },
        "shard_opens": add(lambda w: w["shard_opens"]),
        "shard_open_p99_s": max(p99) if p99 else None,
        "worker_restarts": add(lambda w: w["worker_restarts"]),
    }


def format_table(rows: list[dict]) -> str:
    cols = [
        ("reader", "{}"),
        ("num_workers", "{}"),
        ("samples_per_s", "{:,.0f}"),
        ("tokens_per_s", "{:,.0f}"),
        ("mb_per_s", "{:,.1f}"),
        ("first_batch_s", "{:.2f}"),
        ("wait_fraction", "{:.1%}"),
        ("wait_fraction_range", "{0[0]:.1%}-{0[1]:.1%}"),
        ("padding_efficiency", "{:.3f}"),
        ("peak_rss_mb", "{:,.0f}"),
        ("read_mb_per_s", "{:,.1f}"),
        ("cache_hit_rate", "{:.1%}"),
        ("shard_open_p99_ms", "{:.1f}"),
    ]
    if not any(r.get("wait_fraction_range") for r in rows):  # one round each: no range to show
        cols = [c for c in cols if c[0] != "wait_fraction_range"]
    header = " | ".join(c for c, _ in cols)
    lines = [header, " | ".join("---" for _ in cols)]
    for r in rows:
        lines.append(" | ".join(fmt.format(r[c]) if r.get(c) is not None else "-" for c, fmt in cols))
    return "\n".join(lines)


def write_json(path: str, payload: dict) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for name in sorted({r["reader"] for r in rows}):
        rs = sorted((r for r in rows if r["reader"] == name), key=lambda r: r["num_workers"])
        ax1.plot([r["num_workers"] for r in rs], [r["samples_per_s"] for r in rs], marker="o", label=name)
        ax2.plot([r["num_workers"] for r in rs], [100 * r["wait_fraction"] for r in rs], marker="o", label=name)
    ax1.set_xlabel("num_workers per rank")
    ax1.set_ylabel("samples/s per node")
    ax1.set_yscale("log")
    ax2.set_xlabel("num_workers per rank")
    ax2.set_ylabel("data-wait fraction (%)")
    for ax in (ax1, ax2):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
