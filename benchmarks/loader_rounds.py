"""The loader benchmark's rounds: every run in its own process, the sides alternating.

``measure`` starts one run (``loader_throughput --one``, `loader_runs`) and reads its result;
the rest pair ours with webdataset and the peers round by round, prepare and verify the peers'
copies of the corpora, and measure what the loader's metrics cost.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # the checkout, also via shardtool/benchmarks
# A run is this benchmark's own entry point with ``--one`` (so that peak RSS is the run's own).
ENTRY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "loader_throughput.py")


# ---------------------------------------------------------------------- one run in its own process
def measure(
    which: str,
    root: str,
    kind: str,
    workers: int,
    resume: bool = False,
    max_s: float = 30.0,
    cache_dir: str | None = None,
    verify: bool = False,
    passes: int = 1,
    shuffle_block: str | None = None,
) -> dict:
    """One run in its own process; ``which``: "ours", "ours-nometrics" (metrics=False), "wds" or a peer."""
    cmd = (
        [
            sys.executable,
            ENTRY,
            "--one",
            which,
            "--root",
            root,
            "--kind",
            kind,
            "--workers",
            str(workers),
            "--max-seconds",
            str(max_s),
        ]
        + (["--resume"] if resume else [])
        + (["--cache-dir", cache_dir] if cache_dir else [])
        + (["--passes", str(passes)] if passes != 1 else [])
        + (["--shuffle-block", shuffle_block] if shuffle_block else [])
    )
    cmd += ["--verify"] if verify else []
    env = {**os.environ, "PYTHONPATH": ROOT}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if res.returncode:
        raise SystemExit(
            f"{which} {kind} w={workers} failed (exit {res.returncode}; {' '.join(cmd)}):\n{res.stderr[-3000:]}"
        )
    return json.loads(res.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------- rounds
def paired(root: str, kind: str, workers: int, repeats: int, max_s: float) -> tuple[dict, list[float]]:
    """Ours and the peer, back to back, alternating who goes first; medians and per-round ratios."""
    metric = "samples_per_s" if kind == "tokens" else "mb_per_s"
    for which in ("ours", "wds"):
        measure(which, root, kind, workers, max_s=max_s)  # warm the page cache and imports for both alike
    runs: dict[str, list[dict]] = {"ours": [], "wds": []}
    ratios = []
    for r in range(repeats):
        for which in ("ours", "wds") if r % 2 == 0 else ("wds", "ours"):
            runs[which].append(measure(which, root, kind, workers, max_s=max_s))
        ratios.append(runs["ours"][-1][metric] / runs["wds"][-1][metric])
    out = {}
    for which, rs in runs.items():
        med = {k: (statistics.median(r[k] for r in rs) if rs[0][k] is not None else None) for k in rs[0]}
        med["spread"] = (min(r[metric] for r in rs), max(r[metric] for r in rs))
        out[which] = med
    return out, ratios


def paired_sides(
    root: str, kind: str, workers: int, repeats: int, max_s: float, sides: list[str], warm: bool = True
) -> tuple[dict, dict[str, list[float]]]:
    """``paired`` for ours and every peer in ``sides``: each round runs all sides, the order rotating;
    per peer, the per-round ratio ours/peer."""
    metric = "samples_per_s" if kind == "tokens" else "mb_per_s"
    for which in sides if warm else ():
        measure(which, root, kind, workers, max_s=max_s)  # warm-up, alike for all
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    ratios: dict[str, list[float]] = {s: [] for s in sides if s != "ours"}
    for r in range(repeats):
        k = r % len(sides)
        for which in sides[k:] + sides[:k]:
            runs[which].append(measure(which, root, kind, workers, max_s=max_s))
        for peer in ratios:
            ratios[peer].append(runs["ours"][-1][metric] / runs[peer][-1][metric])
    out = {}
    for which, rs in runs.items():
        med = {k: (statistics.median(r[k] for r in rs) if rs[0][k] is not None else None) for k in rs[0]}
        med["spread"] = (min(r[metric] for r in rs), max(r[metric] for r in rs))
        med["first_batch_runs_s"] = [r["first_batch_s"] for r in rs]
        out[which] = med
    return out, ratios


def prepare_peers(names: list[str], tok: str, img: str) -> dict[str, dict]:
    """Each peer's copy of both corpora in its own format (``<root>-<peer>``), written once; versions."""
    from shardtool.benchmarks import peers

    mods = peers.available()
    info = {}
    for name in names:
        info[name] = {"version": mods[name].version()}
        for root, kind in ((tok, "tokens"), (img, "images")):
            if not os.path.isdir(f"{root}-{name}"):
                t = time.perf_counter()
                mods[name].prepare(root, f"{root}-{name}.tmp", kind, 2)
                os.rename(f"{root}-{name}.tmp", f"{root}-{name}")
                info[name][f"prepare_{kind}_s"] = time.perf_counter() - t
    return info


def verify_sides(sides: list[str], tok: str, img: str, workers: tuple[int, ...] = (0, 2)) -> dict:
    """Every side's whole epoch of each corpus, checked against the tar shards; raises on a mismatch."""
    from shardtool.benchmarks.peers import expected

    checked = {}
    for root, kind in ((tok, "tokens"), (img, "images")):
        n, total = expected(root, kind)
        for which in sides:
            for w in workers if kind == "tokens" else (2,):
                got = measure(which, root, kind, w, verify=True)
                if (got["samples"], got["unique"], got["checksum"]) != (n, n, total):
                    raise SystemExit(
                        f"{which} {kind} w={w} read {got['samples']} samples ({got['unique']} unique, "
                        f"checksum {'ok' if got['checksum'] == total else 'WRONG'}); "
                        f"the corpus has {n}"
                    )
                checked[f"{kind}/{which}/w{w}"] = got["samples"]
    return checked


def metrics_overhead(tok: str, repeats: int, max_s: float, as_json: bool) -> None:
    """tokens/s with metrics on over off, per round (alternating who goes first); the median."""
    out = {}
    for w in (0, 2):
        for which in ("ours", "ours-nometrics"):
            measure(which, tok, "tokens", w, max_s=max_s)  # warm-up, alike for both
        ratios = []
        for r in range(repeats):
            order = ("ours", "ours-nometrics") if r % 2 == 0 else ("ours-nometrics", "ours")
            got = {which: measure(which, tok, "tokens", w, max_s=max_s)["tokens_per_s"] for which in order}
            ratios.append(got["ours"] / got["ours-nometrics"])
        out[f"metrics on/off tokens/s w{w}"] = {"median": statistics.median(ratios), "runs": ratios}
    if as_json:
        print(json.dumps(out, indent=1))
        return
    for name, r in out.items():
        v = r["median"]
        print(
            f"{name:<32}{v:8.3f}x  [{min(r['runs']):.3f}-{max(r['runs']):.3f}] "
            f"(target >= 0.97x: {'met' if v >= 0.97 else 'MISSED'})"
        )
