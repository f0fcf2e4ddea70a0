"""How much step time the DP ranks lose waiting for the slowest, without and with compute balance.

Real long documents: every stdlib .py file and /usr/share/doc text on this machine, untruncated,
as byte ids (`benchmarks.realdocs`), packed ``best-fit`` into rows of ``seq_len`` tokens, planned
for 8 DP ranks on one node and 64 on eight nodes (from metadata only: no data is read). Each
batch's cost is the cost model's (default: Llama-7B's shape, ``6 N`` per token and ``6 x layers x
hidden x L^2`` per document piece of ``L`` tokens). Printed per layout: per-step max/mean cost
across the DP ranks (median, p90) and the share of step time lost, ``1 - sum(mean) / sum(max)``,
unbalanced (the plan without a cost model) and balanced (``cost_model=``), and the time planning
took. Targets (issue 33): 32k x 1 row, lost <= 2% on 8 and 64 ranks; 128k x 1 row <= 3%; 8k x 4
rows <= 0.5%.

    python -m shardtool.benchmarks.compute_balance [--cost-model llama-7b] [--json]

Not yet here: the cost model's prediction checked against measured step times of a model.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

CASES = [(8192, 4, 0.005), (32768, 1, 0.02), (131072, 1, 0.03)]  # seq_len, rows per batch, target
LAYOUTS = [(1, 8), (8, 8)]  # nodes, ranks per node


def run(cost_spec: str = "llama-7b") -> list[dict]:
    from shardtool.plan import ArraySource, Batching, DataLayout, Layout
    from shardtool.plan.cost import CostModel
    from shardtool.plan.packing import Packing
    from shardtool.plan.simulate import simulate_epoch

    from .realdocs import long_document_lengths

    lengths = long_document_lengths()
    per = 2000
    source = ArraySource(lengths, [per] * (lengths.size // per) + ([lengths.size % per] if lengths.size % per else []))
    model = CostModel.parse(cost_spec)
    out = []
    for seq, rows, target in CASES:
        for nodes, per_node in LAYOUTS:
            layout = DataLayout.pure_dp(Layout(nodes, per_node))
            plain = Batching(batch_size=rows, packing=Packing(seq, "best-fit"))
            row = {"seq_len": seq, "rows": rows, "dp_ranks": nodes * per_node, "nodes": nodes, "target": target}
            for name, batching in (("unbalanced", plain), ("balanced", plain.with_balance(model))):
                began = time.perf_counter()
                sim = simulate_epoch(source, layout, batching, cost_model=model)
                row[name] = {**sim.balance(), "plan_seconds": time.perf_counter() - began}
            out.append(row)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cost-model", default="llama-7b", help="a preset, params=..,layers=..,hidden=.. or a=..,b=..")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from .realdocs import long_document_lengths

    lengths = long_document_lengths()
    rows = run(args.cost_model)
    if args.json:
        print(json.dumps(rows))
        return 0
    print(
        f"{lengths.size:,} documents, {lengths.sum() / 1e6:.0f}M tokens (byte ids), p50 {np.median(lengths):,.0f}, "
        f"p99 {np.quantile(lengths, 0.99):,.0f}; cost model {args.cost_model}"
    )
    print(f"{'layout':<26}{'unbalanced: median p90 lost':>30}{'balanced: median p90 lost':>30}  target")
    for r in rows:
        u, b = r["unbalanced"], r["balanced"]
        name = f"{r['seq_len']:,} x {r['rows']}, {r['dp_ranks']} ranks"
        cells = [f"{s['max_over_mean_median']:.3f} {s['max_over_mean_p90']:.3f} {s['time_lost']:6.2%}" for s in (u, b)]
        met = "met" if b["time_lost"] <= r["target"] else "MISSED"
        print(f"{name:<26}{cells[0]:>30}{cells[1]:>30}  <= {r['target']:.1%}: {met}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
