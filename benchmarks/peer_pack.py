"""Pack / prepare: Parquet tokens and an image-like file tree into each system's own format.

Same inputs as ``benchmarks.pack_throughput`` (``benchmarks.corpus``: the lognormal token corpus
as Parquet; ~100 KB ``.bin`` + ``.json`` samples in 1,000-file directories), same run, each
measurement a fresh process (timed from after its imports: interpreter and library start-up are
not charged, to any side), sides alternating (the order reversed every other round), medians of ``--repeats``
with their [min–max] over the rounds:

- ours: ``shardtool.pack(src, out, workers=W)`` (tar shards + index), W = 1 and 2;
- MosaicML Streaming: ``MDSWriter`` fed the rows (one process: its writer has no workers; its
  docs' parallel recipe is one writer per process + ``merge_index``, not measured here);
- LitData: ``litdata.optimize(fn, inputs, output_dir, chunk_bytes="64MB", num_workers=W)``,
  inputs = Parquet row groups / image directories, ``fn`` yielding one dict per sample;
- Energon: webdataset's ``ShardWriter`` (one process) then ``energon prepare`` (its indexing,
  ``--num-workers W``), timed together.

Printed: samples/s and MB/s (input bytes) per side, and ours (best of 1 and 2 workers, and at 1
process) over the best peer; target: at least 1x the best peer on each input.

    python -m benchmarks.peer_pack [--tiny|--small] [--token-docs N] [--images N] [--inputs tokens,images]
        [--sides mds:1,litdata:2] [--repeats 3] [--dir DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SHARD_BYTES = 256 << 20


class _RowGroup:
    """optimize's fn: the rows of one Parquet row group as dicts."""

    def __init__(self, src: str):
        self.src = src

    def __call__(self, group: int):
        import pyarrow.parquet as pq

        batch = pq.ParquetFile(self.src).read_row_group(group)
        tok = batch.column("tokens").combine_chunks()
        off, val = tok.offsets.to_numpy(), tok.values.to_numpy()
        for i, source in enumerate(batch.column("source").to_pylist()):
            yield {"tokens": val[off[i] : off[i + 1]], "source": source}


class _Dir:
    """optimize's fn: the samples of one directory of the image tree as dicts."""

    def __call__(self, d: str):
        from shardtool.benchmarks.pack_throughput import tree_samples

        for key, fields in tree_samples(d):
            yield {"key": key, "bin": fields["bin"], "json": fields["json"]}


def side(name: str, src: str, out: str, kind: str) -> int:
    from shardtool.benchmarks import pack_throughput as pt

    what, _, workers = name.partition(":")
    w = int(workers or 1)
    if what == "ours":
        return pt.side_shardtool(src, out, "tar", w, None if kind == "images" else "tokens")
    if what == "mds":
        from shardtool.benchmarks.peers import streaming

        streaming.load()  # its torchvision shim (benchmarks/peers/streaming.py)
        return pt.side_mds(src, out, "images" if kind == "images" else "parquet")
    if what == "litdata":
        import litdata
        import pyarrow.parquet as pq

        if kind == "images":
            fn, inputs = _Dir(), sorted(os.path.join(src, d) for d in os.listdir(src))
        else:
            fn, inputs = _RowGroup(src), list(range(pq.ParquetFile(src).num_row_groups))
        litdata.optimize(
            fn=fn, inputs=inputs, output_dir=out, chunk_bytes="64MB", num_workers=w, mode="overwrite", verbose=False
        )
        return -1  # counted by the harness from the input
    if what == "energon":
        n = pt.side_shardwriter(src, out, "images" if kind == "images" else "parquet")
        cli = os.path.join(os.path.dirname(sys.executable), "energon")
        subprocess.run(
            [
                cli,
                "prepare",
                out,
                "--non-interactive",
                "--force-overwrite",
                "--split-ratio",
                "1,0,0",
                "--sample-type",
                "CrudeWebdataset",
                "--num-workers",
                str(w),
                "--no-progress",
            ],
            check=True,
            capture_output=True,
            timeout=3600,
        )
        return n
    raise SystemExit(f"unknown side {name}")


def _preimport(name: str) -> None:
    import pyarrow.parquet  # noqa: F401

    import shardtool  # noqa: F401

    what = name.partition(":")[0]
    if what == "mds":
        from shardtool.benchmarks.peers import streaming

        streaming.load()
    elif what == "litdata":
        import litdata  # noqa: F401
    elif what == "energon":
        import webdataset  # noqa: F401


def measure(name: str, src: str, kind: str, work: str) -> float:
    out = os.path.join(work, "out-" + name.replace(":", "-"))
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.peer_pack", "--one", name, "--src", src, "--out", out, "--kind", kind],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
    )
    if proc.returncode:
        raise SystemExit(f"{name} {kind} failed:\n{proc.stderr[-3000:]}")
    wall = json.loads(proc.stdout.strip().splitlines()[-1])["seconds"]
    shutil.rmtree(out, ignore_errors=True)
    os.sync()  # untimed: one side's dirty pages are not charged to the next
    return wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="2,000 token samples, 60 images (the smoke test)")
    p.add_argument("--small", action="store_true", help="20,000 token samples, 2,000 images")
    p.add_argument(
        "--token-docs",
        type=int,
        default=None,
        help="token documents (default 100,000, ~120 MB of Parquet; --small 20,000; --tiny 2,000)",
    )
    p.add_argument("--images", type=int, default=None, help="image samples (default 4,000; --small 2,000; --tiny 60)")
    p.add_argument("--inputs", default="tokens,images", help="which inputs: tokens, images or both")
    p.add_argument(
        "--sides",
        default=None,
        help="comma-separated sides (default: ours:1,ours:2 and every installed peer's: mds:1, litdata:1, "
        "litdata:2, energon:1, energon:2); ours:1 and ours:2 are always run",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--src", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--kind", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        _preimport(args.one)
        t = time.perf_counter()  # the clock starts with the libraries imported, for every side alike
        n = side(args.one, args.src, args.out, args.kind)
        print(json.dumps({"samples": n, "seconds": time.perf_counter() - t}))
        return
    import tempfile

    from shardtool.benchmarks import corpus, peers
    from shardtool.benchmarks.pack_throughput import payload_bytes

    n_tok, n_img = (2_000, 60) if args.tiny else (20_000, 2_000) if args.small else (100_000, 4_000)
    n_tok, n_img = args.token_docs or n_tok, args.images or n_img
    base = args.dir or tempfile.mkdtemp(prefix="peer-pack-")
    tok_dir, img = os.path.join(base, f"tokens-{n_tok}"), os.path.join(base, f"images-{n_img}")
    if "tokens" in args.inputs.split(",") and not os.path.exists(os.path.join(tok_dir, "tokens.parquet")):
        corpus.write_tokens(tok_dir, n_tok, jsonl=False)
    inputs = args.inputs.split(",")
    if "images" in inputs and not os.path.isdir(img):
        corpus.write_images(img + ".tmp", n_img, per_dir=30 if args.tiny else 1000)
        os.rename(img + ".tmp", img)
    have = peers.available()
    sides = (
        ["ours:1", "ours:2"]
        + (["mds:1"] if "streaming" in have else [])
        + (["litdata:1", "litdata:2"] if "litdata" in have else [])
        + (["energon:1", "energon:2"] if "energon" in have else [])
    )
    if args.sides:
        wanted = ["ours:1", "ours:2"] + [x for x in args.sides.split(",") if x and not x.startswith("ours")]
        if set(wanted) - set(sides):
            raise SystemExit(f"sides not available here: {sorted(set(wanted) - set(sides))} (have {sides})")
        sides = wanted
    report = {"versions": {k: m.version() for k, m in have.items()}, "missing": peers.missing(), "cases": {}}
    work = os.path.join(base, "work")
    os.makedirs(work, exist_ok=True)
    for kind, src, n in (("tokens", os.path.join(tok_dir, "tokens.parquet"), n_tok), ("images", img, n_img)):
        if kind not in inputs:
            continue
        runs: dict[str, list[float]] = {s: [] for s in sides}
        for r in range(args.repeats):
            for s in sides if r % 2 == 0 else sides[::-1]:
                runs[s].append(measure(s, src, kind, work))
        nbytes = payload_bytes(src)
        res = {
            s: {
                "wall_s": statistics.median(v),
                "samples_per_s": n / statistics.median(v),
                "MB_per_s": nbytes / statistics.median(v) / 1e6,
                "samples_per_s_spread": (n / max(v), n / min(v)),
                "runs_s": v,
            }
            for s, v in runs.items()
        }
        peer_best = (
            max((v["samples_per_s"], s) for s, v in res.items() if not s.startswith("ours")) if len(sides) > 2 else None
        )
        ours_best = max(res["ours:1"]["samples_per_s"], res["ours:2"]["samples_per_s"])
        peers_1 = [s for s in sides if s.endswith(":1") and not s.startswith("ours")]
        # Per round: ours (best of its two) over the best peer of that round, and 1 process each.
        best_rounds = (
            [
                min(runs[s][r] for s in sides if not s.startswith("ours")) / min(runs["ours:1"][r], runs["ours:2"][r])
                for r in range(args.repeats)
            ]
            if peer_best
            else []
        )
        one_rounds = (
            [min(runs[s][r] for s in peers_1) / runs["ours:1"][r] for r in range(args.repeats)] if peers_1 else []
        )
        report["cases"][kind] = {
            "samples": n,
            "MB": nbytes / 1e6,
            "sides": res,
            "best_peer": peer_best,
            "ours_best_over_best_peer": ours_best / peer_best[0] if peer_best else None,
            "ours_1_over_best_peer_1": res["ours:1"]["samples_per_s"] / max(res[s]["samples_per_s"] for s in peers_1)
            if peers_1
            else None,
            "rounds_best_over_best_peer": best_rounds,
            "rounds_1_over_best_peer_1": one_rounds,
        }
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"peers: {report['versions']}; missing: {report['missing'] or 'none'}")
    for kind, c in report["cases"].items():
        print(f"\n== {kind}: {c['samples']:,} samples, {c['MB']:,.1f} MB input (median of {args.repeats})")
        for s, v in c["sides"].items():
            lo, hi = v["samples_per_s_spread"]
            print(
                f"  {s:<12}{v['samples_per_s']:>12,.0f} samples/s {f'[{lo:,.0f}–{hi:,.0f}]':>19}"
                f"{v['MB_per_s']:>10,.1f} MB/s{v['wall_s']:>9.2f} s"
            )
        if c["best_peer"]:
            x, rb, r1 = c["ours_best_over_best_peer"], c["rounds_best_over_best_peer"], c["rounds_1_over_best_peer_1"]
            print(
                f"  ours (best of 1, 2 workers) / best peer ({c['best_peer'][1]}): {x:.2f}x "
                f"[{min(rb):.2f}–{max(rb):.2f} per round] (target >= 1x: {'met' if x >= 1 else 'MISSED'})"
                + (f"; 1 process each: {c['ours_1_over_best_peer_1']:.2f}x [{min(r1):.2f}–{max(r1):.2f}]" if r1 else "")
            )


if __name__ == "__main__":
    main()
