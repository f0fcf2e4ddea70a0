"""Image classification epoch: ShardedLoader vs ImageFolder + DataLoader, same transform, same workers.

The corpus is every PNG of the Adwaita icon theme on this machine as an ImageFolder tree (one
class per icon category: ``actions``, ``status``, …; names like ``x-symbolic.symbolic.png``),
packed once with ``--label-from-dir``. Both sides run one shuffled epoch of batches of 32 with the
same per-sample transform (PIL decode, RGB, resize to 64×64, to a float tensor C×H×W in [0, 1],
as torchvision's ``ToTensor``) and default collation to an image tensor ``[32, 3, 64, 64]`` and a
label ``LongTensor [32]``:

- ours: ``ShardedLoader(ds, batch_size=32, transform=…, num_workers=W)``;
- the peer: torchvision's ``ImageFolder`` + ``DataLoader(batch_size=32, num_workers=W,
  sampler=DistributedSampler(…))``. Where torchvision cannot be imported (its PyPI wheels are CUDA
  builds, which a CPU torch cannot load), a hand-written equivalent: the same class discovery
  (``find_classes``), the same file listing and ``pil_loader`` (open the file, ``Image.open``,
  ``convert("RGB")``), the same DataLoader and sampler. The report says which one ran.

Every run is its own fresh process (imports done before the clock starts; the clock covers
building the loader, starting its workers and the whole epoch). After one warm-up of each side
(page cache), the sides alternate for ``--repeats`` rounds; the table gives the median epoch time
with its min–max spread and the median of the per-round ratios (peer time / ours). CPU seconds
(trainer and workers) are printed too: on a shared 2-core machine they are steadier than wall time.

Where the time goes (``breakdown``): the decode + transform of every image in one process; the
per-batch transfer of a collated batch through a worker's shared-memory slot (written in the
worker, copied out in the trainer); a worker's start (fork, reopening the dataset and its shard,
the first batch's own reads) from an epoch with a trivial transform.

Peers (``benchmarks.peer_images``), each installed one: MosaicML Streaming, LitData and
Megatron-Energon, each with the tree written by its own writer (untimed), read shuffled by its own
loader with the same transform into the same batches; every side's whole epoch is checked first
(count, unique keys, crc32 of png + label) and each peer's time / ours is printed per round's median.

    python -m benchmarks.image_epoch [--repeats 5] [--workers 0,2] [--peers a,b|none] [--dir DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from shardtool.benchmarks.image_corpus import (
    BATCH,
    ours_transform,
    peer_dataset,
    prepare,
    trivial_transform,
)
from shardtool.benchmarks.peer_images import SIZE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = 1.2  # ours at least this much faster than the peer at 2 workers
PEERS = ("streaming", "litdata", "energon")  # each on its own copy: benchmarks.peer_images


# ---------------------------------------------------------------------- one run (own process)
def _cpu() -> tuple[float, float]:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def run_one(which: str, tree: str, ds: str, workers: int) -> dict:
    import torch  # noqa: F401 - imported before the clock, like the trainer that imports it anyway
    from PIL import Image  # noqa: F401
    from torch.utils.data import DataLoader, DistributedSampler

    from shardtool.loader import ShardedLoader

    if which in PEERS:
        from shardtool.benchmarks.peers import available

        available()[which]  # the peer's package imported before the clock, like ours

    c0, began = _cpu(), time.perf_counter()
    first = None
    samples = 0
    peer_name = None
    if which in PEERS:  # a peer on its own copy (benchmarks.peer_images), beside the dataset
        from shardtool.benchmarks import peer_images

        for images, labels, _ in peer_images.loader(which, peer_images.peer_root(ds, which), workers, BATCH):
            first = first if first is not None else time.perf_counter() - began
            samples += len(labels)
    elif which == "peer":
        dataset, peer_name = peer_dataset(tree)
        sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
        loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=workers)
        for images, labels in loader:
            first = first if first is not None else time.perf_counter() - began
            samples += len(labels)
        del loader  # joins its workers, so their CPU is counted
    else:
        tf = trivial_transform if which == "ours-trivial" else ours_transform
        loader = ShardedLoader(
            ds,
            batch_size=BATCH,
            num_workers=workers,
            transform=tf,
            pin_memory=False,
            rank=0,
            world_size=1,
            metrics_dir=os.path.join(os.path.dirname(ds), "metrics"),
        )
        for batch in loader:
            first = first if first is not None else time.perf_counter() - began
            samples += len(batch["cls"])
            images = batch["png"]
        loader.close()
    seconds = time.perf_counter() - began
    c1 = _cpu()
    if tuple(images.shape[1:]) != (3, *SIZE):
        raise SystemExit(f"{which}: images of shape {tuple(images.shape)}, not stacked [B, 3, {SIZE[0]}, {SIZE[1]}]")
    return {
        "seconds": seconds,
        "first_batch_s": first,
        "samples": samples,
        "trainer_cpu_s": c1[0] - c0[0],
        "workers_cpu_s": c1[1] - c0[1],
        "peer": peer_name,
    }


def measure(which: str, tree: str, ds: str, workers: int) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.image_epoch",
        "--one",
        which,
        "--tree",
        tree,
        "--ds",
        ds,
        "--workers",
        str(workers),
    ]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    if res.returncode:
        raise SystemExit(f"{which} w={workers} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------- breakdown (this process)
def breakdown(tree: str, ds: str) -> dict:
    """Decode + transform of every image in one process; one batch's trip through a slot."""
    import torch

    from shardtool.format import open_dataset
    from shardtool.loader.collate import stack_column
    from shardtool.loader.shmring import Slot, decode, encode

    dataset = open_dataset(ds)
    raw = [dataset.read(s, i) for s in range(dataset.num_shards) for i in range(int(dataset.shard_counts[s]))]
    dataset.close()
    c, t = time.process_time(), time.perf_counter()
    out = [ours_transform(dict(r)) for r in raw]
    decode_cpu, decode_wall = time.process_time() - c, time.perf_counter() - t
    slot = Slot()
    trips = []
    for _ in range(50):
        slot.reset()
        began = time.perf_counter()
        batch = {
            "__key__": [r["__key__"] for r in out[:BATCH]],
            "png": stack_column([r["png"] for r in out[:BATCH]], slot.empty),
            "cls": stack_column([r["cls"] for r in out[:BATCH]], slot.empty),
        }
        decode(encode(batch, slot), slot)
        trips.append(time.perf_counter() - began)
    slot.close()
    per_image = decode_cpu / len(raw)
    return {
        "images": len(raw),
        "decode_transform_cpu_s": decode_cpu,
        "decode_transform_wall_s": decode_wall,
        "per_image_ms": per_image * 1e3,
        "slot_trip_ms": statistics.median(trips) * 1e3,
        "batch_mb": BATCH * 3 * SIZE[0] * SIZE[1] * 4 / 1e6,
        "torch_threads": torch.get_num_threads(),
    }


# ---------------------------------------------------------------------- report
def paired(tree: str, ds: str, workers: int, repeats: int, peers: tuple[str, ...] = ()) -> dict:
    """Ours, ImageFolder and ``peers``: a warm-up each, then ``repeats`` rounds, the order rotating;
    medians, spreads, and per side the median of the per-round ratios (its time / ours)."""
    sides = ["ours", "peer", *peers]
    for which in sides:
        measure(which, tree, ds, workers)  # warm-up: page cache, first-run effects, for all alike
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    ratios: dict[str, list[float]] = {s: [] for s in sides[1:]}
    for r in range(repeats):
        k = r % len(sides)
        for which in sides[k:] + sides[:k]:
            runs[which].append(measure(which, tree, ds, workers))
        for which in ratios:
            ratios[which].append(runs[which][-1]["seconds"] / runs["ours"][-1]["seconds"])
    out: dict = {}
    for which, rs in runs.items():
        out[which] = {
            k: statistics.median(r[k] for r in rs)
            for k in ("seconds", "first_batch_s", "trainer_cpu_s", "workers_cpu_s")
        }
        out[which]["spread"] = (min(r["seconds"] for r in rs), max(r["seconds"] for r in rs))
        out[which]["samples"] = rs[0]["samples"]
        if which != "ours":
            out[which]["ratio"] = statistics.median(ratios[which])
            out[which]["ratio_spread"] = (min(ratios[which]), max(ratios[which]))
    out["peer_name"] = runs["peer"][0]["peer"]
    out["ratio"], out["ratio_spread"] = out["peer"]["ratio"], out["peer"]["ratio_spread"]
    return out


def load_average() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "n/a"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", help="where the tree and dataset are made (default: a temporary directory)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-images", type=int, default=None, help="a spread subset of the icons (the smoke test)")
    ap.add_argument("--verify-only", action="store_true", help="write and check every side's epoch; no timing")
    ap.add_argument("--workers", default="0,2", help="worker counts to compare (default 0,2)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--peers",
        default=None,
        help="comma-separated peers besides ImageFolder: streaming, litdata, energon (default: every one "
        "installed; 'none' for none)",
    )
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--tree", help=argparse.SUPPRESS)
    ap.add_argument("--ds", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.tree, args.ds, int(args.workers))))
        return
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tree, ds, n = prepare(args.dir or tmp, args.max_images)  # --dir: kept for the next run
        from shardtool.benchmarks import peer_images

        peers = peer_images.chosen(args.peers)
        report = {"images": n, "batch": BATCH, "load_before": load_average(), "runs": {}, "peers": list(peers)}
        report["verified"] = peer_images.prepare_and_verify(
            tree, ds, peers, BATCH, tuple(int(x) for x in args.workers.split(","))
        )
        if args.verify_only:
            print(
                f"verified: {n} images, every side's epoch (count, unique keys, crc32 of png + label): {report['verified']}"
            )
            return
        for w in [int(x) for x in args.workers.split(",")]:
            report["runs"][f"w{w}"] = paired(tree, ds, w, args.repeats, peers)
            if w:
                trivial = [measure("ours-trivial", tree, ds, w) for _ in range(3)]
                base = [measure("ours-trivial", tree, ds, 0) for _ in range(3)]
                report["runs"][f"w{w}"]["start"] = {
                    "first_batch_s": statistics.median(r["first_batch_s"] for r in trivial),
                    "first_batch_s_in_process": statistics.median(r["first_batch_s"] for r in base),
                    "loader_cpu_s": statistics.median(r["trainer_cpu_s"] + r["workers_cpu_s"] for r in trivial),
                    "loader_cpu_s_in_process": statistics.median(r["trainer_cpu_s"] for r in base),
                }
        report["breakdown"] = breakdown(tree, ds)
        report["load_after"] = load_average()
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print_report(report)


def print_report(rep: dict) -> None:
    b = rep["breakdown"]
    first = next(iter(rep["runs"].values()))
    print(
        f"image classification epoch: {rep['images']} real PNG icons, batch {rep['batch']}, decode + RGB + resize "
        f"{SIZE[0]}x{SIZE[1]} + to float tensor; peer: {first['peer_name']}; load average {rep['load_before']} "
        f"before, {rep['load_after']} after"
    )
    print(
        f"{'workers':<8} {'ShardedLoader s (range)':<26} {'peer s (range)':<26} {'peer/ours (range)':<22} "
        f"{'CPU s ours / peer':<20} first batch ours / peer"
    )
    for name, r in rep["runs"].items():
        o, p = r["ours"], r["peer"]
        print(
            f"{name[1:]:<8} {o['seconds']:.2f} ({o['spread'][0]:.2f}-{o['spread'][1]:.2f}){'':<12}"
            f"{p['seconds']:.2f} ({p['spread'][0]:.2f}-{p['spread'][1]:.2f}){'':<12}"
            f"{r['ratio']:.2f}x ({r['ratio_spread'][0]:.2f}-{r['ratio_spread'][1]:.2f}){'':<6}"
            f"{o['trainer_cpu_s'] + o['workers_cpu_s']:.2f} / {p['trainer_cpu_s'] + p['workers_cpu_s']:.2f}{'':<9}"
            f"{o['first_batch_s']:.2f} / {p['first_batch_s']:.2f}"
        )
    if rep.get("peers"):
        from shardtool.benchmarks import peer_images

        peer_images.print_peers(rep)
    w2 = rep["runs"].get("w2")
    if w2 is not None:
        verdict = "met" if w2["ratio"] >= TARGET else "MISSED"
        print(f"target at 2 workers: >= {TARGET}x: {verdict}")
    print("where the time goes:")
    print(
        f"  decode + transform, one process: {b['decode_transform_cpu_s']:.2f} CPU s for {b['images']} images "
        f"({b['per_image_ms']:.3f} ms an image)"
    )
    print(
        f"  per-batch transfer through a worker slot (stack in the slot, copy out; {b['batch_mb']:.1f} MB): "
        f"{b['slot_trip_ms']:.2f} ms a batch"
    )
    for name, r in rep["runs"].items():
        s = r.get("start")
        if s:
            print(
                f"  worker start ({name[1:]} workers, trivial transform): first batch {s['first_batch_s']:.2f} s "
                f"against {s['first_batch_s_in_process']:.2f} s in process; the loader's own CPU for the epoch "
                f"{s['loader_cpu_s']:.2f} s against {s['loader_cpu_s_in_process']:.2f} s in process"
            )


if __name__ == "__main__":
    main()
