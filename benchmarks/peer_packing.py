"""Packed ``seq_len`` rows of one token corpus: ours (best-fit, concat) against LitData's TokensLoader.

The corpus is the lognormal token corpus of ``benchmarks.loader_throughput`` (median ~350 int32
tokens per document, tar shards). Each side delivers shuffled batches of ``--rows`` rows of
``seq_len`` tokens, the documents ending in an eos (id 0):

- ours, full: ``ShardedLoader(root, seq_len=S, batch_size=B, packing="best-fit"|"concat", eos_id=0,
  num_workers=W)``: ``input_ids``, ``labels``, ``position_ids`` (int64 [B, S] each), ``cu_seqlens``
  and the documents' keys per batch (the default);
- ours, lean (``/lean``, like for like with LitData): the same with ``packed_outputs="lean"``:
  ``input_ids`` int32 [B, S] (the stored dtype), ``cu_seqlens``, ``max_seqlen``, ``lengths``; labels
  and positions follow on the GPU (``shardtool.loader.packed.lean_to_full``), as LitData's labels
  are a shifted view of its ids;
- ours, ``stream`` (``packing="stream"``): the stored token stream cut into rows, only rows
  shuffled, as LitData's blocks are; ``@arrow``: read from Arrow shards of the same documents,
  each ending in its eos as stored (``shardtool.pack(..., format="arrow")``, as LitData's optimize
  stores them; no ``eos_id`` at load), where a row's tokens lie side by side and are one copy;
- LitData, its documented pretraining path: ``optimize(fn, inputs, output_dir,
  item_loader=TokensLoader(), chunk_bytes=…)`` with ``fn`` yielding each document's tokens +
  eos as a tensor, then ``StreamingDataset(dir, item_loader=TokensLoader(block_size=S + 1),
  shuffle=True)`` in ``StreamingDataLoader(batch_size=B, num_workers=W)``: one ``[B, S+1]``
  tensor per batch (inputs and shifted labels are views of it); blocks cut the concatenated
  stream, so every row is full and a document crossing a block boundary is split;
- llm-foundry's ``BinPackCollator``: llm-foundry is not installable here (it pins an older
  torch and pulls composer), so the row is ``benchmarks.packing``'s reimplementation from its
  description, labelled as one: plan only (lengths, one core), no batch is built.

Printed per side: tokens/s (row tokens delivered per second of the steady state; ours also real
tokens), fill (real / row tokens of the batches delivered: ours counts its padding, in rows and
whole rows of padding that keep every batch B rows; LitData's rows are always full, and it drops
instead the tokens of each chunk past its last whole block, printed beside it), documents split
(ours: from its plan; LitData: counted from the document offsets against the block boundaries).
Each read runs in its own process after a warm-up; ``--repeats`` rounds alternate the order;
medians, ratio ours (real tokens/s) / LitData (row tokens/s) per round, for every one of our sides.

    python -m benchmarks.peer_packing [--tiny|--small] [--seq-lens 2048,8192] [--workers 0,2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
EOS = 0


class _Docs:
    """optimize's fn: every document of one tar shard, tokens + eos, as an int32 tensor."""

    def __call__(self, path: str):
        import torch

        from shardtool.benchmarks.peers import tar_samples

        for _, tokens in tar_samples(os.path.dirname(path), "tokens", [path]):
            yield torch.from_numpy(np.append(tokens, np.int32(EOS)).astype(np.int32))


def prepare_litdata(src: str, out: str, workers: int = 1) -> None:
    import litdata
    from litdata.streaming.item_loader import TokensLoader

    from shardtool.benchmarks.peers import tar_paths

    litdata.optimize(
        fn=_Docs(),
        inputs=tar_paths(src),
        output_dir=out,
        item_loader=TokensLoader(),
        chunk_bytes="64MB",
        num_workers=max(1, workers),
        mode="overwrite",
        verbose=False,
    )


def prepare_arrow(src: str, out: str) -> None:
    """The corpus's documents, each + eos, in Arrow shards (the eos stored, as LitData's optimize
    input above has it)."""
    import shardtool
    from shardtool.benchmarks.peers import tar_samples

    docs = ({"tokens": np.append(t, np.int32(EOS)).astype(np.int32)} for _, t in tar_samples(src, "tokens"))
    shardtool.pack(docs, out, format="arrow", length="tokens", overwrite=True)


def litdata_dropped_tokens(out: str, block: int) -> int:
    """Tokens TokensLoader never serves: each chunk's tail past its last whole block."""
    with open(os.path.join(out, "index.json")) as f:
        return sum(int(c["dim"]) % block for c in json.load(f)["chunks"])


def litdata_split_docs(src: str, block: int) -> int:
    """Documents (eos included) whose tokens fall in more than one block of the concatenated stream.

    optimize writes the inputs' documents in order per worker; with one chunk stream per input
    order this is the count for the written order (a good estimate either way: the lengths are iid)."""
    from shardtool.benchmarks.peers import tar_samples

    sizes = np.array([len(t) + 1 for _, t in tar_samples(src, "tokens")], np.int64)
    end = np.cumsum(sizes)
    start = end - sizes
    return int(np.count_nonzero(start // block != (end - 1) // block))


def run_side(side: str, src: str, seq: int, rows: int, workers: int, max_s: float) -> dict:
    began = time.perf_counter()
    if side == "litdata":
        import litdata
        from litdata.streaming.item_loader import TokensLoader

        ds = litdata.StreamingDataset(
            f"{src}-litdata-tokensloader", item_loader=TokensLoader(block_size=seq + 1), shuffle=True, seed=0
        )
        loader = litdata.StreamingDataLoader(ds, batch_size=rows, num_workers=workers)
        fill, split = 1.0, None
    else:
        from shardtool.loader import ShardedLoader

        name, _, fmt = side.partition("@")
        policy, _, outputs = name.partition("/")
        loader = ShardedLoader(
            f"{src}-arrow-eos" if fmt else src,
            seq_len=seq,
            batch_size=rows,
            packing=policy,
            eos_id=None if fmt else EOS,  # @arrow: stored
            num_workers=workers,
            pin_memory=False,
            metrics=False,
            packed_outputs=outputs or "full",
        )
        split = loader.plan.rows.split_docs
        fill = None  # measured over the batches delivered
    first = None
    row_tokens = real = n_rows = 0
    for batch in loader:
        if first is None:
            first, t0 = time.perf_counter() - began, time.perf_counter()
            continue  # the steady state starts after the first batch
        if side == "litdata":
            row_tokens += batch.numel()
            real += batch.numel()
            n_rows += batch.shape[0]
        else:
            row_tokens += batch["input_ids"].numel()
            real += int(batch["lengths"].sum())
            n_rows += batch["input_ids"].shape[0]
        if time.perf_counter() - t0 > max_s:
            break
    el = time.perf_counter() - t0 if first is not None else 0.0
    if fill is None:
        fill = real / row_tokens if row_tokens else None
    return {
        "first_batch_s": first,
        "seconds": el,
        "rows": n_rows,
        "row_tokens_per_s": row_tokens / el if el else None,
        "real_tokens_per_s": real / el if el else None,
        "fill": fill,
        "docs_split": split,
    }


def measure(side: str, src: str, seq: int, rows: int, workers: int, max_s: float) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.peer_packing",
        "--one",
        side,
        "--src",
        src,
        "--seq-lens",
        str(seq),
        "--rows",
        str(rows),
        "--workers",
        str(workers),
        "--max-seconds",
        str(max_s),
    ]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=ROOT, check=False)
    if res.returncode:
        raise SystemExit(f"{side} seq {seq} w={workers} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="3,000 documents (the smoke test)")
    p.add_argument("--small", action="store_true", help="30,000 documents")
    p.add_argument("--docs", type=int, default=200_000)
    p.add_argument("--seq-lens", default="2048,8192")
    p.add_argument("--rows", type=int, default=None, help="rows per batch (default 65,536 tokens / seq_len)")
    p.add_argument("--workers", default="0,2")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-seconds", type=float, default=20.0)
    p.add_argument("--sides", default=None, help="ours to run, comma-separated (default: all)")
    p.add_argument("--dir", default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--src", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(
            json.dumps(run_side(args.one, args.src, int(args.seq_lens), args.rows, int(args.workers), args.max_seconds))
        )
        return
    from shardtool.benchmarks import peers
    from shardtool.benchmarks.loader_corpus import write_tokens
    from shardtool.benchmarks.packing import llm_foundry

    n = 3_000 if args.tiny else 30_000 if args.small else args.docs
    base = args.dir or tempfile.mkdtemp(prefix="peer-packing-")
    src = os.path.join(base, f"tokens-{n}")
    if not os.path.exists(os.path.join(src, "index.json")):
        os.makedirs(src, exist_ok=True)
        write_tokens(src, n, 500 if args.tiny else 10_000)
    ours = ["best-fit", "concat", "best-fit/lean", "concat/lean", "stream/lean", "stream@arrow", "stream/lean@arrow"]
    ours += ["best-fit/lean@arrow"]
    if args.sides:
        ours = [x for x in args.sides.split(",") if x]
    sides = list(ours)
    if any(x.endswith("@arrow") for x in ours) and not os.path.isdir(f"{src}-arrow-eos"):
        prepare_arrow(src, f"{src}-arrow-eos.tmp")
        os.rename(f"{src}-arrow-eos.tmp", f"{src}-arrow-eos")
    have = "litdata" in peers.available()
    if have:
        sides.append("litdata")
        if not os.path.isdir(f"{src}-litdata-tokensloader"):
            prepare_litdata(src, f"{src}-litdata-tokensloader.tmp", 2)
            os.rename(f"{src}-litdata-tokensloader.tmp", f"{src}-litdata-tokensloader")
    sizes = np.array([len(t) + 1 for _, t in peers.tar_samples(src, "tokens")], np.int64)
    report = {
        "docs": n,
        "litdata": peers.available()["litdata"].version() if have else peers.missing().get("litdata"),
        "runs": [],
    }
    for seq in [int(x) for x in args.seq_lens.split(",")]:
        rows = args.rows or max(1, 65536 // seq)
        foundry = llm_foundry(sizes, seq, rows)
        for w in [int(x) for x in args.workers.split(",")]:
            for side in sides:
                measure(side, src, seq, rows, w, args.max_seconds)  # warm-up
            runs: dict[str, list[dict]] = {s: [] for s in sides}
            for r in range(args.repeats):
                k = r % len(sides)
                for side in sides[k:] + sides[:k]:
                    runs[side].append(measure(side, src, seq, rows, w, args.max_seconds))
            out = {"seq_len": seq, "rows": rows, "workers": w, "sides": {}}
            for side, rs in runs.items():
                med = {k: statistics.median(r[k] for r in rs) for k in ("row_tokens_per_s", "real_tokens_per_s")}
                med.update(
                    real_range=[min(r["real_tokens_per_s"] for r in rs), max(r["real_tokens_per_s"] for r in rs)],
                    fill=statistics.median(r["fill"] for r in rs),
                    docs_split=rs[0]["docs_split"],
                    first_batch_s=rs[0]["first_batch_s"],
                )
                out["sides"][side] = med
            if have:
                out["sides"]["litdata"]["docs_split"] = litdata_split_docs(src, seq + 1)
                out["litdata_dropped_tokens"] = litdata_dropped_tokens(f"{src}-litdata-tokensloader", seq + 1)
                for side in ours:
                    per_round = [
                        a["real_tokens_per_s"] / b["row_tokens_per_s"] for a, b in zip(runs[side], runs["litdata"])
                    ]
                    out[f"{side}/litdata"] = statistics.median(per_round)
                    out[f"{side}/litdata range"] = [min(per_round), max(per_round)]
            out["sides"]["BinPackCollator (reimpl., plan only)"] = {
                "row_tokens_per_s": foundry["tokens_per_s"] / foundry["fill"],
                "real_tokens_per_s": foundry["tokens_per_s"],
                "fill": foundry["fill"],
                "docs_split": foundry["docs_split"],
                "first_batch_s": None,
            }
            report["runs"].append(out)
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"{report['docs']:,} lognormal documents; LitData: {report['litdata']}")
    print(f"{'seq':>6}{'w':>3}  {'side':<38}{'real tok/s':>14}{'row tok/s':>14}{'fill':>8}{'docs split':>12}")
    for out in report["runs"]:
        for side, r in out["sides"].items():
            print(
                f"{out['seq_len']:>6}{out['workers']:>3}  {side:<38}{r['real_tokens_per_s']:>14,.0f}"
                f"{r['row_tokens_per_s']:>14,.0f}{r['fill']:>8.4f}{r['docs_split'] if r['docs_split'] is not None else 'n/a':>12}"
            )
        if "litdata_dropped_tokens" in out:
            print(f"  LitData drops {out['litdata_dropped_tokens']:,} tokens (each chunk's tail past its last block)")
        for side in ours:
            if f"{side}/litdata" in out:
                v = out[f"{side}/litdata"]
                lo, hi = out[f"{side}/litdata range"]
                goal = 1.0 if out["workers"] == 0 else 2.0  # issue 32 (one process), issue 23 (workers)
                fill_ok = out["sides"][side]["fill"] >= out["sides"]["litdata"]["fill"]
                what = "lean, like for like: ids int32 + cu_seqlens" if "/lean" in side else "full outputs"
                where = ", Arrow shards, eos stored" if side.endswith("@arrow") else ""
                print(
                    f"  ours {side.split('/')[0].split('@')[0]} ({what}{where}) / LitData TokensLoader, real tokens/s vs its row "
                    f"tokens/s: {v:.2f}x [{lo:.2f}-{hi:.2f}] (target >= {goal:g}x: {'met' if v >= goal else 'MISSED'}; fill at least as "
                    f"high: {'met' if fill_ok else 'MISSED'})"
                )


if __name__ == "__main__":
    main()
