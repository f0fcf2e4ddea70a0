"""Adopting existing data: `shardtool index` of tars in place vs `energon prepare`, and converting
MDS / LitData / Megatron datasets vs packing the same rows from Parquet. Same data, same run.

Cases (``--cases``, default both):
  tars     N WebDataset tars (jpg-like random bytes + json + txt per sample), already in the page
           cache: `shardtool index` (1 process, --workers W) vs `energon prepare` (1 worker,
           --num-workers W) on the same tars, and vs our own `pack` of them (which rewrites them).
           Each is a fresh CLI process (start-up included, as a user sees it), median of 3.
  convert  the same token rows (uint16 ids) as a Megatron .bin/.idx, an MDS directory and a LitData
           directory (MDS and LitData written by the peers' own writers, in their venv), each
           packed to tar shards vs packing the same rows from Parquet; 1 process.

Targets (issue 24): index ≥ 2× energon prepare, 1 process and with workers; each conversion
≥ 0.8× the speed of pack from Parquet (ratio = Parquet seconds / conversion seconds).

Energon and the MDS/LitData writers run from the peers' venv (``$SHARDTOOL_PEERS_PYTHON``,
``.venv-peers`` or /work/venv-peers; tests/run.sh makes ``.venv-peers``).

    python -m shardtool.benchmarks.index_tars                      # 16 tars x 2,000 samples; 200k rows
    python -m shardtool.benchmarks.index_tars --small              # 4 tars x 500; 20k rows
    python -m shardtool.benchmarks.index_tars --cases tars --workers 2
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tarfile
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS = (
    os.environ.get("SHARDTOOL_PEERS_PYTHON", ""),
    os.path.join(ROOT, ".venv-peers/bin/python"),
    "/work/venv-peers/bin/python",
)


def peers_python() -> str:
    for p in PEERS:
        if p and os.access(p, os.X_OK):
            return p
    sys.exit("no peers' venv (energon, mosaicml-streaming, litdata): set SHARDTOOL_PEERS_PYTHON or run tests/run.sh")


def env() -> dict:
    return {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}


def timed(cmd: list[str], *, cleanup=None, repeat: int = 3, peer: bool = False) -> float:
    times = []
    for _ in range(repeat):
        if cleanup:
            cleanup()
        e = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} if peer else env()
        t = time.perf_counter()
        res = subprocess.run(cmd, capture_output=True, text=True, env=e)
        times.append(time.perf_counter() - t)
        if res.returncode != 0:
            sys.exit(f"{' '.join(cmd[:4])}… failed:\n{res.stderr[-3000:]}")
    return statistics.median(times)


# ------------------------------------------------------------------ tars
def write_tars(root: str, n: int, per: int) -> int:
    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(0)
    total = 0
    for s in range(n):
        with tarfile.open(os.path.join(root, f"{s:06d}.tar"), "w", format=tarfile.GNU_FORMAT) as tf:
            for i in range(per):
                key = f"{s:06d}{i:06d}"
                img = rng.integers(0, 256, size=int(rng.integers(4000, 16000)), dtype=np.uint8).tobytes()
                for ext, data in (
                    ("jpg", img),
                    ("json", json.dumps({"num_tokens": len(img) // 64}).encode()),
                    ("txt", b"a caption " * int(rng.integers(2, 20))),
                ):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
        total += os.path.getsize(os.path.join(root, f"{s:06d}.tar"))
    return total


def read_all(root: str) -> None:
    for f in sorted(os.listdir(root)):
        if f.endswith(".tar"):
            with open(os.path.join(root, f), "rb") as fh:
                while fh.read(16 << 20):
                    pass


def case_tars(tmp: str, n: int, per: int, workers: int) -> list[str]:
    tars = os.path.join(tmp, "tars")
    size = write_tars(tars, n, per)
    read_all(tars)
    out = os.path.join(tmp, "ds")
    rows = []

    def rm(*paths):
        def go():
            for p in paths:
                shutil.rmtree(p, ignore_errors=True)

        return go

    energon = [
        peers_python(),
        "-m",
        "megatron.energon.cli.main",
        "prepare",
        tars,
        "--non-interactive",
        "--split-ratio",
        "1,0,0",
        "--skip-dataset-yaml",
        "--force-overwrite",
    ]
    energon_bin = os.path.join(os.path.dirname(peers_python()), "energon")
    if os.access(energon_bin, os.X_OK):
        energon = [energon_bin] + energon[3:]
    for w in (1, workers):
        ours = timed(
            [
                sys.executable,
                "-m",
                "shardtool",
                "index",
                os.path.join(tars, "*.tar"),
                "-o",
                out,
                "--overwrite",
                "--workers",
                str(w),
                "--length-field",
                "json:num_tokens",
            ],
            cleanup=rm(out),
        )
        theirs = timed(energon + ["--num-workers", str(w)], cleanup=rm(os.path.join(tars, ".nv-meta")), peer=True)
        packed = timed(
            [
                sys.executable,
                "-m",
                "shardtool",
                "pack",
                os.path.join(tars, "*.tar"),
                "-o",
                out + "-packed",
                "--overwrite",
                "-q",
                "--workers",
                str(w),
                "--length",
                "json",
            ],
            cleanup=rm(out + "-packed"),
        )
        rows.append(
            f"tars  {n}x{per} ({size / 1e6:.0f} MB)  workers={w}:  shardtool index {ours:6.2f} s "
            f"({size / ours / 1e6:6.0f} MB/s)   energon prepare {theirs:6.2f} s   shardtool pack {packed:6.2f} s"
            f"   index/energon speed {theirs / ours:5.2f}x (target >= 2x)   index/pack {packed / ours:5.1f}x"
        )
    return rows


# ------------------------------------------------------------------ conversions
def token_rows(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    lengths = np.clip(rng.lognormal(6.0, 0.8, size=n).astype(np.int64), 1, 16384)
    flat = rng.integers(0, 50000, size=int(lengths.sum()), dtype=np.uint16)
    return np.split(flat, np.cumsum(lengths)[:-1])


def write_megatron(prefix: str, rows: list[np.ndarray]) -> None:
    """The documented MMIDIDX layout (megatron-core datasets/indexed_dataset.py), dtype uint16 (code 8)."""
    lengths = np.array([len(r) for r in rows], np.int32)
    pointers = np.zeros(len(rows), np.int64)
    np.cumsum(lengths[:-1].astype(np.int64) * 2, out=pointers[1:])
    with open(prefix + ".bin", "wb") as f:
        f.write(np.concatenate(rows).tobytes())
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, len(rows), len(rows) + 1))
        f.write(lengths.tobytes() + pointers.tobytes() + np.arange(len(rows) + 1, dtype=np.int64).tobytes())


PEER_WRITER = r"""
import sys, types, importlib.machinery, numpy as np
class _Stub(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"): raise AttributeError(name)
        return type(name, (), {})
for name in ("torchvision", "torchvision.datasets", "torchvision.transforms", "torchvision.transforms.functional", "torchvision.io"):
    m = _Stub(name); m.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True); m.__path__ = []; sys.modules[name] = m
kind, src, out = sys.argv[1:]
data = np.load(src)
flat, offsets = data["flat"], data["offsets"]
rows = (flat[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1))
if kind == "mds":
    from streaming import MDSWriter
    with MDSWriter(out=out, columns={"tokens": "ndarray:uint16"}, size_limit=1 << 26) as w:
        for r in rows:
            w.write({"tokens": r})
else:
    from litdata.streaming.writer import BinaryWriter
    w = BinaryWriter(out, chunk_bytes="64MB")
    for i, r in enumerate(rows):
        w[i] = {"tokens": r}
    w.done(); w.merge()
"""


def case_convert(tmp: str, n: int) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = token_rows(n)
    flat = np.concatenate(rows)
    offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])])
    src = os.path.join(tmp, "rows.npz")
    np.savez(src, flat=flat, offsets=offsets)
    parquet = os.path.join(tmp, "rows.parquet")
    pq.write_table(
        pa.table({"tokens": pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(flat))}),
        parquet,
        row_group_size=65536,
    )
    write_megatron(os.path.join(tmp, "mg"), rows)
    for kind in ("mds", "litdata"):
        res = subprocess.run(
            [peers_python(), "-c", PEER_WRITER, kind, src, os.path.join(tmp, kind)],
            capture_output=True,
            text=True,
            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        )
        if res.returncode != 0:
            sys.exit(f"writing the {kind} dataset failed:\n{res.stderr[-3000:]}")
    out = os.path.join(tmp, "out")

    def pack(source: str) -> float:
        return timed(
            [sys.executable, "-m", "shardtool", "pack", source, "-o", out, "--overwrite", "-q", "--length", "tokens"],
            cleanup=lambda: shutil.rmtree(out, ignore_errors=True),
        )

    mb = flat.nbytes / 1e6
    base = pack(parquet)
    lines = [f"convert {n} rows ({mb:.0f} MB of uint16 ids), 1 process:  Parquet {base:6.2f} s"]
    for name, source in (
        ("Megatron", os.path.join(tmp, "mg")),
        ("MDS", os.path.join(tmp, "mds")),
        ("LitData", os.path.join(tmp, "litdata")),
    ):
        t = pack(source)
        lines.append(f"  {name:8s} {t:6.2f} s   speed vs Parquet {base / t:5.2f}x (target >= 0.8x)")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="tars,convert")
    p.add_argument("--small", action="store_true")
    p.add_argument("--tars", type=int, default=None)
    p.add_argument("--samples", type=int, default=None, help="samples per tar")
    p.add_argument("--rows", type=int, default=None, help="rows to convert")
    p.add_argument("--workers", type=int, default=2)
    a = p.parse_args()
    n_tars = a.tars or (4 if a.small else 16)
    per = a.samples or (500 if a.small else 2000)
    rows = a.rows or (20_000 if a.small else 200_000)
    with tempfile.TemporaryDirectory(prefix="shardtool-index-bench-") as tmp:
        if "tars" in a.cases:
            for line in case_tars(tmp, n_tars, per, a.workers):
                print(line, flush=True)
        if "convert" in a.cases:
            for line in case_convert(tmp, rows):
                print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
