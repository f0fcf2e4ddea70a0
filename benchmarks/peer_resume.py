"""Resume, per loader that can: ours, MosaicML Streaming, LitData, Megatron-Energon.

On the token corpus of ``benchmarks.loader_throughput`` (each peer on its own copy, written by
its own writer as there), batches of ``--batch`` samples, 0 workers, shuffle on. Every check is
run, not read from docs; each step is its own forked process of one parent per side (the
library imported once, before any clock), ranks simulated as the peer's docs set them
(ours: ``rank``/``world_size``; Streaming: ``RANK``/``WORLD_SIZE``/``LOCAL_*`` env with
``num_canonical_nodes=12``, which 4 and 3 divide, as its elastic-resumption docs ask; LitData:
``WORLD_SIZE``/``GLOBAL_RANK`` env; Energon: ``WorkerConfig(rank, world_size)``):

- resume first batch: time to the first batch of a loader built with the state saved at 90% of
  the epoch, against a fresh loader's first batch (target: at most 1.5x); ``--repeats`` pairs, the
  order alternating, each a fresh process: the median per-pair ratio with its [min–max];
- exact mid-epoch resume: one rank reads half the epoch, saves its state; a new loader resumes;
  the two halves against one uninterrupted epoch (same keys in the same order?), and samples
  repeated/skipped against the corpus;
- equal batch counts: 4 ranks, a whole epoch each: batches per rank, samples repeated/skipped;
- another world size: 4 ranks read half their batches and save; 3 ranks resume (rank r from
  rank r's state; ours and Streaming keep one global state) and finish the epoch: samples
  repeated/skipped over all 7 reads, or the error the peer raises.

    python -m benchmarks.peer_resume [--tiny|--small] [--repeats 3] [--dir DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pickle
import statistics
import sys
import tempfile
import time
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def make_loader(side: str, root: str, batch: int, rank: int, world: int, state, repeat: bool = False):
    if side == "ours":
        from shardtool.loader import ShardedLoader

        ld = ShardedLoader(
            root,
            batch_size=batch,
            rank=rank,
            world_size=world,
            ranks_per_node=1,
            num_workers=0,
            pin_memory=False,
            metrics=False,
        )
        if state is not None:
            ld.load_state_dict(state)
        return ld
    from shardtool.benchmarks import peers

    mod = peers.available()[side]
    kw = {"canonical_nodes": 12} if side == "streaming" else {"repeat": repeat} if side == "energon" else {}
    return mod.loader(f"{root}-{side}", "tokens", 0, batch, rank=rank, world_size=world, state=state, **kw)


def _step(side, root, batch, rank, world, state_in, stop, limit, repeat, port, conn) -> None:
    try:
        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        began = time.perf_counter()
        state = pickle.loads(state_in) if state_in is not None else None
        ld = make_loader(side, root, batch, rank, world, state, repeat)
        keys, first, saved, n = [], None, None, 0
        for b in ld:
            first = first if first is not None else time.perf_counter() - began
            keys += list(b["__key__"])
            n += 1
            if stop is not None and n >= stop:
                saved = pickle.dumps(
                    ld.state_dict()
                    if side == "ours"
                    else __import__("shardtool.benchmarks.peers", fromlist=["x"]).available()[side].state_dict(ld, stop)
                )
                break
            if limit is not None and n >= limit:
                break
        conn.send({"keys": keys, "batches": n, "first_batch_s": first, "state": saved})
    except Exception as e:  # noqa: BLE001 - a peer refusing (any error) is a result, not a crash
        conn.send({"error": f"{type(e).__name__}: {str(e)[:300]}"})


def steps(side, root, batch, world=1, states=None, stop=None, limit=None, repeat=False) -> list[dict]:
    """All ranks' reads at once, each a forked child (imports shared, env vars its own): per rank
    keys, batches, first batch time, state (pickled) where ``stop`` batches were read."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if side == "streaming":
        from shardtool.benchmarks.peers import streaming

        streaming.clean()
    ctx = mp.get_context("fork")
    procs = []
    for r in range(world):
        a, b = ctx.Pipe(duplex=False)
        st = states[r] if states else None
        p = ctx.Process(target=_step, args=(side, root, batch, r, world, st, stop, limit, repeat, port, b))
        p.start()
        procs.append((p, a))
    out = []
    for p, a in procs:
        out.append(a.recv() if a.poll(600) else {"error": "no answer in 600 s"})
    for p, _ in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    return out


def step(side, root, batch, state=None, stop=None, limit=None, repeat=False) -> dict:
    return steps(side, root, batch, 1, [state] if state is not None else None, stop, limit, repeat)[0]


def tally(reads: list[list[str]], n: int) -> dict:
    c = Counter(k for r in reads for k in r)
    return {"repeated": sum(v - 1 for v in c.values() if v > 1), "skipped": n - len(c)}


def run_side(side: str, root: str, batch: int, n: int, repeats: int = 1) -> dict:
    if side != "ours":
        from shardtool.benchmarks import peers

        peers.available()[side]  # import before any clock
    out: dict = {}
    full = step(side, root, batch)
    if "error" in full:
        return {"error": full["error"]}
    total = full["batches"]
    out["epoch"] = {"batches": total, **tally([full["keys"]], n)}
    # Energon's training default is repeat=True (endless); its resume is checked so, over the
    # epoch's first `total` batches (with repeat=False a restored loader re-reads samples here).
    rep = side == "energon"
    if rep:
        full = step(side, root, batch, limit=total, repeat=True)
    at90 = step(side, root, batch, stop=max(1, int(total * 0.9)), repeat=rep)
    fresh_s: list[float] = []
    resumed_s: list[float] = []
    err = at90.get("error")
    for r in range(repeats if err is None else 0):  # fresh and resumed alternate who goes first
        for which in ("fresh", "resumed") if r % 2 == 0 else ("resumed", "fresh"):
            got = step(side, root, batch, state=at90["state"] if which == "resumed" else None, limit=1, repeat=rep)
            if "error" in got:
                err = got["error"]
                break
            (fresh_s if which == "fresh" else resumed_s).append(got["first_batch_s"])
        if err is not None:
            break
    ok = err is None and fresh_s and len(fresh_s) == len(resumed_s)
    out["first_batch"] = {
        "fresh_s": statistics.median(fresh_s) if ok else None,
        "resume90_s": statistics.median(resumed_s) if ok else None,
        "fresh_runs_s": fresh_s,
        "resume90_runs_s": resumed_s,
        "ratio_runs": [b / a for a, b in zip(fresh_s, resumed_s)] if ok else [],
        "error": err,
    }
    half = step(side, root, batch, stop=max(1, total // 2), repeat=rep)
    rest = (
        step(side, root, batch, state=half.get("state"), limit=total - total // 2 if rep else None, repeat=rep)
        if "error" not in half
        else half
    )
    if "error" in rest:
        out["mid_epoch"] = {"error": rest["error"]}
    else:
        got = half["keys"] + rest["keys"]
        out["mid_epoch"] = {"exact": got == full["keys"], **tally([half["keys"], rest["keys"]], n)}
    ranks = steps(side, root, batch, world=4)
    errs = [r["error"] for r in ranks if "error" in r]
    out["ranks4"] = (
        {"error": errs[0]}
        if errs
        else {"batches": [r["batches"] for r in ranks], **tally([r["keys"] for r in ranks], n)}
    )
    if not errs:
        stop = max(1, min(r["batches"] for r in ranks) // 2)
        first = steps(side, root, batch, world=4, stop=stop)
        errs = [r["error"] for r in first if "error" in r]
        then = [] if errs else steps(side, root, batch, world=3, states=[first[r]["state"] for r in range(3)])
        errs += [r["error"] for r in then if "error" in r]
        out["world4to3"] = (
            {"error": errs[0]}
            if errs
            else {"batches_after": [r["batches"] for r in then], **tally([r["keys"] for r in first + then], n)}
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="2,000 documents (the smoke test)")
    p.add_argument("--small", action="store_true", help="20,000 documents")
    p.add_argument("--docs", type=int, default=100_000)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--peers", default=None, help="comma-separated peers (default: every one installed)")
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="first-batch timings per side, fresh and resumed alternating who goes first (median, [min–max])",
    )
    p.add_argument("--dir", default=None)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    from shardtool.benchmarks import peers
    from shardtool.benchmarks.loader_corpus import write_tokens

    n = 2_000 if args.tiny else 20_000 if args.small else args.docs
    base = args.dir or tempfile.mkdtemp(prefix="peer-resume-")
    root = os.path.join(base, f"tokens-{n}")
    if not os.path.exists(os.path.join(root, "index.json")):
        os.makedirs(root, exist_ok=True)
        write_tokens(root, n, 250 if args.tiny else 2_500)  # several shards, so 4 ranks have some each
    chosen = list(peers.available()) if args.peers is None else [x for x in args.peers.split(",") if x]
    for side in chosen:
        if not os.path.isdir(f"{root}-{side}"):
            peers.available()[side].prepare(root, f"{root}-{side}.tmp", "tokens", 2)
            os.rename(f"{root}-{side}.tmp", f"{root}-{side}")
    report = {
        "docs": n,
        "batch": args.batch,
        "missing": peers.missing(),
        "versions": {s: peers.available()[s].version() for s in chosen},
        "sides": {},
    }
    for side in ["ours"] + chosen:
        report["sides"][side] = run_side(side, root, args.batch, n, args.repeats)
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"{n:,} documents, batches of {args.batch}, 0 workers; peers: {report['versions']}")
    for name, why in report["missing"].items():
        print(f"  {name}: not measured, {why}")
    for side, r in report["sides"].items():
        if "error" in r:
            print(f"{side:<10} failed to read an epoch: {r['error']}")
            continue
        fb = r["first_batch"]
        if fb["error"]:
            fbs = f"resume at 90%: {fb['error']}"
        else:
            x, fr, rr, xr = (
                statistics.median(fb["ratio_runs"]),
                fb["fresh_runs_s"],
                fb["resume90_runs_s"],
                fb["ratio_runs"],
            )
            fbs = (
                f"first batch fresh {fb['fresh_s']:.3f} s [{min(fr):.3f}–{max(fr):.3f}], resumed at 90% "
                f"{fb['resume90_s']:.3f} s [{min(rr):.3f}–{max(rr):.3f}] = {x:.2f}x [{min(xr):.2f}–{max(xr):.2f}] "
                f"(median of {len(xr)}; target <= 1.5x: {'met' if x <= 1.5 else 'MISSED'})"
            )
        ep = r["epoch"]
        print(f"{side:<10} epoch {ep['batches']} batches ({ep['repeated']} repeated, {ep['skipped']} skipped); {fbs}")

        def words(d):
            return d["error"] if "error" in d else f"{d['repeated']} repeated, {d['skipped']} skipped"

        me = r["mid_epoch"]
        print(
            f"{'':<10} mid-epoch resume: "
            + (
                me["error"]
                if "error" in me
                else f"{'exact' if me['exact'] else 'NOT exact'} (vs an uninterrupted read; against the corpus: {words(me)})"
            )
        )
        r4 = r["ranks4"]
        print(
            f"{'':<10} 4 ranks: "
            + (
                r4["error"]
                if "error" in r4
                else f"batches {r4['batches']} ({'equal' if len(set(r4['batches'])) == 1 else 'UNEQUAL'}), {words(r4)}"
            )
        )
        if "world4to3" in r:
            w = r["world4to3"]
            print(
                f"{'':<10} 4 -> 3 ranks at half: "
                + (w["error"] if "error" in w else f"{words(w)}; batches after per rank {w['batches_after']}")
            )


if __name__ == "__main__":
    main()
