"""Compressed against plain Arrow shards, read by ShardedLoader (``loader_throughput --compression``).

The token corpus packed twice, plain and compressed, read through a warmed node cache (the
compressed shards decompressed there) and in place (no cache: the rank decompresses its share
into memory, `loader.inflate`), num_workers 0 and 2, the sides alternating, medians and the
per-round ratio's range. The 200k-sample corpus is one pass of about a second, too short for a
steady state on a shared machine (single passes of the same side differed by 30%), so each run
reads ``passes`` passes (later ones included: their worker start-ups count) and the rate is over
all of them after the first batch; the first batch (where the in-place side decompresses) is
reported beside it.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable

COMPRESSION_TARGETS = {"cache": 0.95, "inplace": 0.5}
# A pass read in place from the loader's construction (decompression included) against plain's:
# long pretraining runs are often about one pass (issue 32).
FIRST_PASS_TARGET = 0.8


def packed_pair(base: str, name: str, n: int, codec: str, *, seed: int = 0) -> dict:
    """The token corpus ``name`` (``n`` samples) packed as Arrow shards plain and ``codec``-compressed,
    under ``base`` (reused when present): {None: plain root, codec: compressed root}."""
    import shardtool
    from shardtool.format.arrowshard import COMPRESSED_BATCH_BYTES

    from . import corpus

    src = os.path.join(base, f"{name}-src")
    if not os.path.exists(os.path.join(src, "tokens.parquet")):
        corpus.write_tokens(src, n, seed=seed, jsonl=False)
    roots = {}
    for comp in (None, codec):
        # The compressed twin's name carries its record-batch size: a corpus packed by an older
        # shardtool (64 KiB batches) is not silently measured in place of today's layout.
        tail = f"{comp}-b{COMPRESSED_BATCH_BYTES >> 10}k" if comp else "plain"
        roots[comp] = os.path.join(base, f"{name}-arrow-{tail}")
        if not os.path.exists(os.path.join(roots[comp], "index.json")):
            shardtool.pack(
                os.path.join(src, "tokens.parquet"),
                roots[comp],
                format="arrow",
                length="tokens",
                shard_size="64MiB",
                compression=comp,
            )
    return roots


def compression_runs(
    measure: Callable[..., dict],
    base: str,
    corpora: dict[str, int],
    codec: str,
    repeats: int,
    modes: tuple[str, ...],
    passes: int = 3,
) -> dict:
    """samples/s of the same Arrow dataset plain and ``codec``-compressed, per corpus, mode and
    worker count, alternating, medians. Modes: ``cache`` (both warmed into a node cache first: the
    compressed one is decompressed there) and ``inplace`` (no cache: read where they lie).
    ``measure(root, workers, cache_dir, passes)``: one run in its own process."""
    import shardtool
    from shardtool.cache import warm

    out: dict = {}
    for name, n in corpora.items():
        roots = packed_pair(base, name, n, codec)
        info = shardtool.open_dataset(roots[codec]).manifest
        plain_bytes = sum(s.raw_bytes or s.bytes for s in info.shards)
        res: dict = {
            "samples": n,
            "passes": passes,
            "stored_bytes": info.num_bytes,
            "plain_bytes": plain_bytes,
            "size_ratio": plain_bytes / info.num_bytes,
        }
        caches = {}
        if "cache" in modes:
            for comp, root in roots.items():
                caches[comp] = os.path.join(base, f"{name}-cache-{comp or 'plain'}")
                r = warm(root, caches[comp], all_shards=True, jobs=2, progress=False)
                if r.status != "ok":
                    raise SystemExit(f"warm of {root} failed: {r.error}")
        for mode in modes:
            for w in (0, 2):
                where = {c: (caches[c] if mode == "cache" else None) for c in roots}
                for comp, root in roots.items():
                    measure(root, w, where[comp], 1)  # warm-up: page cache, imports
                runs: dict = {None: [], codec: []}
                for r in range(repeats):
                    for comp in (None, codec) if r % 2 == 0 else (codec, None):
                        runs[comp].append(measure(roots[comp], w, where[comp], passes))
                rate = {c: statistics.median(x["samples_per_s"] for x in v) for c, v in runs.items()}
                first = {c: statistics.median(x["first_batch_s"] for x in v) for c, v in runs.items()}
                passes_of = {
                    key: _pass_ratio(runs[None], runs[codec], key)
                    for key in ("first_pass_samples_per_s", "later_passes_samples_per_s")
                }
                res[f"{mode}/w{w}"] = {
                    "plain_samples_per_s": rate[None],
                    "compressed_samples_per_s": rate[codec],
                    "ratio": rate[codec] / rate[None],
                    "ratio_runs": [c["samples_per_s"] / p["samples_per_s"] for p, c in zip(runs[None], runs[codec])],
                    "plain_first_batch_s": first[None],
                    "compressed_first_batch_s": first[codec],
                    "first_pass": passes_of["first_pass_samples_per_s"],
                    "later_passes": passes_of["later_passes_samples_per_s"],
                }
        out[name] = res
    return out


def _pass_ratio(plain: list[dict], compressed: list[dict], key: str) -> dict | None:
    """Medians and per-round ratios of one pass rate (``first_pass_samples_per_s``: from the
    loader's construction, decompression included; ``later_passes_samples_per_s``)."""
    if not all(key in r for r in plain + compressed):
        return None
    p, c = statistics.median(r[key] for r in plain), statistics.median(r[key] for r in compressed)
    return {
        "plain": p,
        "compressed": c,
        "ratio": c / p,
        "ratio_runs": [b[key] / a[key] for a, b in zip(plain, compressed)],
    }


def print_compression(compressed: dict, codec: str) -> None:
    for name, res in compressed.items():
        print(
            f"\n{name}: {res['samples']:,} token samples, Arrow shards {res['stored_bytes'] / 1e6:,.0f} MB {codec} "
            f"/ {res['plain_bytes'] / 1e6:,.0f} MB plain ({res['size_ratio']:.2f}x); {res['passes']} passes a run"
        )
        print(
            f"  {'mode':<10}{'workers':>8}{'plain/s':>12}{codec + '/s':>12}{'ratio':>8}{'range':>13}"
            f"{'1st batch plain':>17}{codec:>7}  target"
        )
        for key, r in res.items():
            if not isinstance(r, dict):
                continue
            mode, w = key.split("/")
            goal = COMPRESSION_TARGETS[mode]
            lo, hi = min(r["ratio_runs"]), max(r["ratio_runs"])
            print(
                f"  {mode:<10}{w[1:]:>8}{r['plain_samples_per_s']:>12,.0f}{r['compressed_samples_per_s']:>12,.0f}"
                f"{r['ratio']:>7.2f}x{f'{lo:.2f}-{hi:.2f}':>13}{r['plain_first_batch_s']:>16.2f}s"
                f"{r['compressed_first_batch_s']:>6.2f}s  >= {goal}x: {'met' if r['ratio'] >= goal else 'MISSED'}"
            )
            for label, key, want in (
                ("first pass", "first_pass", FIRST_PASS_TARGET),
                ("later passes", "later_passes", None),
            ):
                q = r.get(key)
                if q:
                    lo, hi = min(q["ratio_runs"]), max(q["ratio_runs"])
                    goal_text = (
                        f"  >= {want}x: {'met' if q['ratio'] >= want else 'MISSED'}"
                        if want and mode == "inplace"
                        else ""
                    )
                    print(
                        f"    {label:<14}{q['plain']:>12,.0f}{q['compressed']:>12,.0f}{q['ratio']:>7.2f}x"
                        f"{f'{lo:.2f}-{hi:.2f}':>13}{goal_text}"
                    )
