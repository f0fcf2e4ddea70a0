"""Merging the metric lines of every rank of a run (the JSONL files each node wrote) into tables.

Pure: files in, dicts out (and a plot); no torch. ``shardtool stats`` prints them.
A rank's totals come from its last line per process (its cumulative counters); a rank that ran
in several processes (a restarted or resumed job in the same run) adds them up. Per node, the
ranks' counters add up. The slowest ranks are those that spent the largest share of their time
waiting for data: in synchronous training the whole job steps at their pace.
"""

from __future__ import annotations

import glob
import json
import os
from collections import defaultdict
from collections.abc import Collection
from typing import Any

# Cumulative counters that add up across processes and ranks (nested: "a.b").
ADDITIVE = (
    "seconds",
    "batches",
    "samples",
    "tokens",
    "padded_tokens",
    "wait_s",
    "produce_s",
    "bytes_read.cache",
    "bytes_read.local",
    "bytes_read.remote",
    "cache.hits",
    "cache.misses",
    "cache.fetch_bytes",
    "shard_opens",
    "worker_starts",
    "worker_restarts",
)


class StatsError(ValueError):
    """No metric lines where the user pointed, or the run asked for is not there."""


def metric_files(paths: list[str]) -> list[str]:
    files = []
    for p in paths:
        if os.path.isdir(p):
            files += glob.glob(os.path.join(p, "**", "*.jsonl"), recursive=True)
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise StatsError(f"{p}: no such file or directory")
    return sorted(set(files))


def read_lines(files: list[str]) -> tuple[list[dict], int]:
    """Every metric line of ``files``, and how many lines could not be read (a torn last line)."""
    lines, bad = [], 0
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            for text in f:
                try:
                    line = json.loads(text)
                except ValueError:
                    bad += 1
                    continue
                if isinstance(line, dict) and "cumulative" in line and "rank" in line:
                    lines.append(line)
    return lines, bad


def runs(lines: list[dict]) -> dict[str, list[dict]]:
    """Lines per run id, oldest run first. A run id that names no job (``master-ADDR-PORT`` of a
    static rendezvous, ``local``) is the same for every launch that reuses the address, so its
    lines are told apart by launch: ``ID#1``, ``ID#2``, ... (`_launches`)."""
    out: dict[str, list[dict]] = defaultdict(list)
    for line in lines:
        out[str(line.get("run", "?"))].append(line)
    split: dict[str, list[dict]] = {}
    for run, got in out.items():
        launches = _launches(got) if run == "local" or run.startswith("master-") else [got]
        if len(launches) == 1:
            split[run] = launches[0]
        else:
            split.update((f"{run}#{k}", launch) for k, launch in enumerate(launches, 1))
    return dict(sorted(split.items(), key=lambda kv: min(x.get("time", 0) for x in kv[1])))


def _launches(lines: list[dict]) -> list[list[dict]]:
    """A run's lines by launch: loaders (start, pid) in order of start, a new launch where a rank
    comes again in another process (a job relaunched, or another job on the same address: no id
    tells which). One process's several loaders (training and evaluation) are one launch."""
    by: dict[tuple, list[dict]] = defaultdict(list)
    for line in lines:
        by[(line.get("start", 0), line.get("pid", 0), int(line["rank"]))].append(line)
    out: list[list[dict]] = []
    pids: dict[int, int] = {}  # rank -> its process in the current launch
    for (_, pid, rank), got in sorted(by.items()):
        if not out or pids.get(rank, pid) != pid:
            out.append([])
            pids = {}
        pids[rank] = pid
        out[-1].extend(got)
    return out


def _get(d: dict, key: str) -> float:
    value: Any = d  # a JSON value: a nested dict on the way down, a number (or absent) at the end
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return float(value or 0)


SECONDS = {"seconds", "wait_s", "produce_s"}


def _sum(rows: list[dict], key: str, get=lambda row, k: row[k]):
    total = sum(get(r, key) for r in rows)
    return float(total) if key in SECONDS else int(total)


def _totals(cums: list[dict]) -> dict:
    t = {k: _sum(cums, k, _get) for k in ADDITIVE}
    t["wait_fraction"] = t["wait_s"] / t["seconds"] if t["seconds"] else None
    t["tokens_per_s"] = t["tokens"] / t["seconds"] if t["seconds"] else None
    t["samples_per_s"] = t["samples"] / t["seconds"] if t["seconds"] else None
    t["padding_efficiency"] = t["tokens"] / t["padded_tokens"] if t["padded_tokens"] else None
    opens = t["cache.hits"] + t["cache.misses"]
    t["cache_hit_rate"] = t["cache.hits"] / opens if opens else None
    return t


def _sessions(lines: list[dict]) -> list[list[dict]]:
    """One rank's lines per process (pid, start), each in step order, oldest process first."""
    by: dict[tuple, list[dict]] = defaultdict(list)
    for line in lines:
        by[(line.get("start", 0), line.get("pid", 0))].append(line)
    return [sorted(v, key=lambda x: x.get("step", 0)) for _, v in sorted(by.items())]


def summarize(lines: list[dict], top: int = 3) -> dict:
    """Per rank, per node and the slowest ranks of one run's lines."""
    per_rank: dict[int, list[dict]] = defaultdict(list)
    for line in lines:
        per_rank[int(line["rank"])].append(line)
    ranks = []
    for r, rl in sorted(per_rank.items()):
        sessions = _sessions(rl)
        last = [s[-1] for s in sessions]
        row = {
            "rank": r,
            "node": last[-1].get("node"),
            "host": last[-1].get("host"),
            "steps": sum(int(x.get("step", 0)) for x in last),
            "processes": len(sessions),
            **_totals([x["cumulative"] for x in last]),
        }
        p99 = [x["cumulative"].get("shard_open_p99_s") for x in last]
        row["shard_open_p99_s"] = max((p for p in p99 if p is not None), default=None)
        ranks.append(row)
    nodes = []
    for node in sorted({r["node"] for r in ranks}, key=lambda n: (n is None, n)):
        mine = [r for r in ranks if r["node"] == node]
        t = {k: _sum(mine, k) for k in ADDITIVE}
        row = {
            "node": node,
            "hosts": sorted({str(r["host"]) for r in mine}),
            "ranks": len(mine),
            **t,
            "wait_fraction": t["wait_s"] / t["seconds"] if t["seconds"] else None,
            "tokens_per_s": sum(r["tokens_per_s"] or 0 for r in mine),
        }
        opens = t["cache.hits"] + t["cache.misses"]
        row["cache_hit_rate"] = t["cache.hits"] / opens if opens else None
        nodes.append(row)
    slowest = sorted(ranks, key=lambda r: (-(r["wait_fraction"] or 0), r["tokens_per_s"] or 0))[:top]
    return {
        "ranks": ranks,
        "nodes": nodes,
        "slowest": [{k: r[k] for k in ("rank", "node", "host", "wait_fraction", "tokens_per_s")} for r in slowest],
    }


def step_balance_of(lines: list[dict]) -> dict:
    """How long one run's steps waited for the slowest DP rank, from its lines: the batch costs
    of a loader with a cost model (``batch_costs``) and the step times the trainer reported
    (``step_times``, `ShardedLoader.report_step_time`), lined up by (epoch, step) across ranks.
    Only steps every rank of the run recorded count; a step is ``micro_batches`` batches (what
    a step's micro-batches cost or took adds up; a line's step times are the batches before it,
    so the last step before a line is in the next).
    {"plan_cost": ..., "step_time": ...}, each `shardtool.plan.cost.step_balance` or None."""
    import numpy as np

    from ...plan.cost import step_balance

    world = max((int(x.get("world_size", 1)) for x in lines), default=1)
    micro = max((int(x.get("micro_batches", 1)) for x in lines), default=1)
    # (rank, epoch, batch) -> value. A batch served again by a later process of the rank (a
    # resume from a state saved before it) counts once, as that process saw it; the step times
    # one process reports for one batch add up (forward and backward timed apart).
    batch_cost: dict[tuple, float] = {}
    batch_time: dict[tuple, list] = {}  # -> [process, seconds]
    bad: set[tuple] = set()
    for line in lines:
        r, epoch, process = int(line["rank"]), int(line.get("epoch", 0)), (line.get("start"), line.get("pid"))
        bc = line.get("batch_costs")
        if bc:
            for i, c in enumerate(bc.get("cost", [])):
                batch_cost[(r, epoch, int(bc["from"]) + i)] = float(c)
        for e, b, t in line.get("step_times", []):
            key = (r, int(e), int(b))
            if not 0 <= float(t) < float("inf"):  # (NaN too) a file from before report_step_time refused it
                bad.add(key)  # the step is left out: a NaN sum would read as no time lost
                continue
            seen = batch_time.get(key)
            if seen is not None and seen[0] == process:
                seen[1] += float(t)
            else:
                batch_time[key] = [process, float(t)]
    # (epoch, step) -> rank -> [sum, micro-batches seen]
    cost: dict[tuple, dict[int, list]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    times: dict[tuple, dict[int, list]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    for per_step, values in ((cost, batch_cost.items()), (times, ((k, v[1]) for k, v in batch_time.items()))):
        for (r, e, b), value in values:
            cell = per_step[(e, b // micro)][r]
            cell[0] += value
            cell[1] += 1
    for r, e, b in bad:
        times[(e, b // micro)][r][1] = -1  # never complete

    def table(per_step: dict) -> dict | None:
        # A step counts once every rank recorded all its micro-batches (an epoch's short last
        # step never does: a plan's figure counts it).
        steps = sorted(k for k, v in per_step.items() if len(v) == world and all(n == micro for _, n in v.values()))
        if not steps:
            return None
        return step_balance(np.array([[per_step[k][r][0] for k in steps] for r in range(world)]))

    return {"plan_cost": table(cost), "step_time": table(times)}


def series(lines: list[dict]) -> dict[int, dict[str, list]]:
    """Per rank: step, wait fraction and tokens/s of every line's window (for plots); the steps
    of a later process of the same rank continue after the earlier one's."""
    per_rank: dict[int, list[dict]] = defaultdict(list)
    for line in lines:
        per_rank[int(line["rank"])].append(line)
    out = {}
    for r, rl in sorted(per_rank.items()):
        steps, wait, tps, offset = [], [], [], 0
        for s in _sessions(rl):
            for x in s:
                w = x.get("window", {})
                steps.append(offset + int(x.get("step", 0)))
                wait.append(w.get("wait_fraction"))
                tps.append(w.get("tokens_per_s"))
            offset = steps[-1] if steps else offset
        out[r] = {"step": steps, "wait_fraction": wait, "tokens_per_s": tps}
    return out


# ---------------------------------------------------------------------- plot
def plot(run: str, lines: list[dict], path: str, highlight: Collection[int] = ()) -> None:
    """Wait fraction and tokens/s per rank over steps, one line per rank, to a PNG."""
    try:
        import matplotlib
    except ImportError:
        raise StatsError("--plot needs matplotlib: pip install 'shardtool[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = series(lines)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for r, d in data.items():
        style: dict[str, Any] = (
            {"linewidth": 2.2, "label": f"rank {r}"} if r in highlight else {"linewidth": 0.9, "alpha": 0.7}
        )
        if len(data) <= 12:
            style.setdefault("label", f"rank {r}")
        ax1.plot(d["step"], [100 * (w or 0) for w in d["wait_fraction"]], **style)
        ax2.plot(d["step"], [t or 0 for t in d["tokens_per_s"]], **style)
    ax1.set_ylabel("data wait (% of time)")
    ax2.set_ylabel("tokens/s")
    ax2.set_xlabel("step")
    ax1.set_title(f"shardtool loader, run {run}")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    ax1.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
