"""The loader benchmark's table: every side's medians per configuration, then each ratio and its target.

Apart from `loader_throughput` (which runs the rounds) so that how the results are printed can be
read, and changed, without the measurement around it.
"""

from __future__ import annotations


# ---------------------------------------------------------------------- report
def fmt(v, spec=",.0f") -> str:
    return "n/a" if v is None else format(v, spec)


def print_results(
    results: dict,
    ratios: dict[str, float],
    ratio_runs: dict[str, list[float]],
    peer_info: dict[str, dict],
    missing: dict[str, str],
    checked: dict | None,
) -> None:
    """The table of ``results`` and the ``ratios`` against their targets; the peers' versions (and
    the ``missing`` ones, with why) and the verified reads first."""
    head = (
        f"{'run':<20}{'samples/s':>12}{'tokens/s':>14}{'MB/s':>9}{'range':>17}{'1st batch':>11}{'resume 90%':>12}"
        f"{'pad eff':>9}{'RSS MB':>9}{'wkr RSS':>9}"
    )
    for name, info in peer_info.items():
        print(f"peer {name}: {info['version']}")
    for name, why in missing.items():
        print(f"peer {name}: not measured, {why}")
    if checked:
        print(f"verified: every side read each corpus whole (count, unique keys, payload crc32): {len(checked)} reads")
    print(head)
    for name, r in results.items():
        lo, hi = r["spread"]
        rng = f"{lo:,.0f}-{hi:,.0f}"
        print(
            f"{name:<20}{fmt(r['samples_per_s']):>12}{fmt(r['tokens_per_s']):>14}{fmt(r['mb_per_s']):>9}{rng:>17}"
            f"{fmt(r['first_batch_s'], '.3f'):>11}{fmt(r.get('resume_first_batch_s'), '.3f'):>12}"
            f"{fmt(r['padding_efficiency'], '.3f'):>9}{fmt(r['peak_rss_mb']):>9}{fmt(r['workers_peak_rss_mb']):>9}"
        )
    print("(range: min-max over the runs of samples/s for tokens, MB/s for images)")
    targets = {"tokens samples/s ours/wds w0": 50, "tokens samples/s ours/wds w2": 10, "images MB/s ours/wds w2": 2}
    for k, v in ratios.items():
        goal = targets.get(k) or (2 if "ours/" in k else None)  # the issue's target against every peer
        if goal:
            runs_ = ratio_runs[k]
            note = f"[{min(runs_):.1f}-{max(runs_):.1f}] (target >= {goal}x: {'met' if v >= goal else 'MISSED'})"
        else:
            runs_ = ratio_runs[k]
            note = f"[{min(runs_):.2f}-{max(runs_):.2f}] (target <= 1.5x: {'met' if v <= 1.5 else 'MISSED'})"
        print(f"{k:<36}{v:8.2f}x  {note}")
