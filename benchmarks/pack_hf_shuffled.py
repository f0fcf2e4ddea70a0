"""Packing a shuffled + selected Hugging Face Dataset against the same rows flattened (issue 20 #12).

Real-ish rows: the first ``--doc-bytes`` of every stdlib ``.py`` file as ``uint8`` token ids,
cycled to ``--rows`` documents, twice as many rows in the Dataset as are selected after the
shuffle (a random subset, the usual way). Prints one line per side and worker count: seconds
to pack (``flatten_indices()`` itself timed apart) and the dataset version, which must match.

    python -m benchmarks.pack_hf_shuffled                 # 30,000 rows, workers 1 and 2
    python -m benchmarks.pack_hf_shuffled --rows 5000 --workers 1
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import sysconfig
import tempfile
import time

import numpy as np


def stdlib_table(rows: int, doc_bytes: int):
    import pyarrow as pa

    paths = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), recursive=True))
    docs: list[np.ndarray] = []
    for i in range(10 * rows):
        if len(docs) == rows:
            break
        with open(paths[i % len(paths)], "rb") as f:
            data = f.read(doc_bytes)
        if data:
            docs.append(np.frombuffer(data, np.uint8))
    offsets = np.zeros(len(docs) + 1, np.int32)
    np.cumsum([len(d) for d in docs], out=offsets[1:])
    return pa.table(
        {
            "tokens": pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(docs))),
            "doc": pa.array(np.arange(len(docs), dtype=np.int64)),
        }
    )


def main(argv=None) -> int:
    import datasets

    import shardtool

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=30_000)
    p.add_argument("--doc-bytes", type=int, default=4096)
    p.add_argument("--workers", default="1,2")
    a = p.parse_args(argv)
    datasets.disable_progress_bars()
    table = stdlib_table(2 * a.rows, a.doc_bytes)
    shuffled = datasets.Dataset(table).shuffle(seed=1).select(range(a.rows))
    t = time.perf_counter()
    flat = shuffled.flatten_indices()
    print(f"flatten_indices(): {time.perf_counter() - t:.2f} s")
    work = tempfile.mkdtemp(prefix="pack-hf-")
    try:
        for w in map(int, a.workers.split(",")):
            for name, src in (("flattened", flat), ("indices-mapped", shuffled)):
                out = os.path.join(work, f"{name}-{w}")
                t = time.perf_counter()
                r = shardtool.pack(src, out, format="arrow", length="tokens", workers=w)
                took = time.perf_counter() - t
                print(
                    f"workers={w} {name:15s} {took:6.2f} s  {r.samples} samples  {shardtool.open_dataset(out).version}",
                    flush=True,
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
