"""Run with the peers' venv (tests/helpers/peers.py): write a dataset with MosaicML Streaming's MDSWriter or
LitData's optimize(), or read one back with their own readers, dumping rows as tagged JSON lines.

    python peers_tool.py mds-write OUT [COMPRESSION]     rows of real text (the stdlib's .py files)
    python peers_tool.py mds-read DIR OUT.jsonl
    python peers_tool.py litdata-write OUT [COMPRESSION]
    python peers_tool.py litdata-read DIR OUT.jsonl

Streaming imports torchvision at import time for its vision datasets; where torchvision is a CUDA
build over a CPU torch that import fails ("operator torchvision::nms does not exist"), so a stub
stands in for it: nothing here touches images through torchvision.
"""

from __future__ import annotations

import base64
import importlib.machinery
import json
import os
import sys
import sysconfig
import types


class _Stub(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})


def stub_torchvision() -> None:
    for name in (
        "torchvision",
        "torchvision.datasets",
        "torchvision.transforms",
        "torchvision.transforms.functional",
        "torchvision.io",
    ):
        mod = _Stub(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        mod.__path__ = []
        sys.modules[name] = mod


def stdlib_rows(n: int = 120) -> list[dict]:
    import numpy as np

    root = sysconfig.get_paths()["stdlib"]
    paths = sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith(".py"))
    paths = [p for p in paths if os.path.getsize(p) > 0][:n]
    rows = []
    for i, p in enumerate(paths):
        data = open(p, "rb").read()
        rows.append(
            {
                "id": i,
                "text": data.decode("utf-8", "replace"),
                "tokens": np.frombuffer(data, np.uint8).astype(np.uint16),
                "score": np.float32(len(data) / 1000.0),
                "meta": {"name": os.path.basename(p), "lines": data.count(b"\n")},
                "blob": data[:100],
            }
        )
    return rows


def tag(v):
    import numpy as np

    if isinstance(v, (bytes, bytearray, memoryview)):
        return {"b64": base64.b64encode(bytes(v)).decode()}
    if isinstance(v, np.ndarray):
        return {"nd": v.dtype.str, "v": v.tolist()}
    if hasattr(v, "numpy") and not isinstance(v, np.generic):  # a torch tensor
        return tag(v.numpy())
    if isinstance(v, np.generic):
        return {"np": v.dtype.str, "v": v.item()}
    return v


def mds_write(out: str, compression: str | None) -> None:
    stub_torchvision()
    from streaming import MDSWriter

    cols = {"id": "int", "text": "str", "tokens": "ndarray:uint16", "score": "float32", "meta": "json", "blob": "bytes"}
    with MDSWriter(out=out, columns=cols, compression=compression, hashes=["sha1", "xxh64"], size_limit=1 << 18) as w:
        for row in stdlib_rows():
            w.write(row)


def mds_read(root: str, out: str) -> None:
    stub_torchvision()
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    ds = StreamingDataset(local=root, shuffle=False, batch_size=1)
    with open(out, "w") as f:
        for i in range(ds.num_samples):
            f.write(json.dumps({k: tag(v) for k, v in ds.get_item(i).items()}) + "\n")


def _lit_row(row):
    return row


def litdata_write(out: str, compression: str | None) -> None:
    from litdata import optimize

    rows = stdlib_rows()
    items = [
        {"id": r["id"], "text": r["text"], "tokens": r["tokens"], "score": float(r["score"]), "blob": r["blob"]}
        for r in rows
    ]
    level = None
    if compression == "zstd-chunk":  # whole-file zstd (the default for zstd is per batch of items)
        compression, level = "zstd", "chunk"
    optimize(
        fn=_lit_row,
        inputs=items,
        output_dir=out,
        chunk_bytes="64KB",
        num_workers=1,
        compression=compression,
        mode="overwrite",
        **({"compression_level": level} if level else {}),
    )


def litdata_read(root: str, out: str) -> None:
    from litdata import StreamingDataset

    ds = StreamingDataset(root, shuffle=False)
    with open(out, "w") as f:
        for i in range(len(ds)):
            f.write(json.dumps({k: tag(v) for k, v in ds[i].items()}) + "\n")


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    if cmd == "mds-write":
        mds_write(args[0], args[1] if len(args) > 1 and args[1] != "none" else None)
    elif cmd == "mds-read":
        mds_read(args[0], args[1])
    elif cmd == "litdata-write":
        litdata_write(args[0], args[1] if len(args) > 1 and args[1] != "none" else None)
    elif cmd == "litdata-read":
        litdata_read(args[0], args[1])
    else:
        sys.exit(f"unknown command {cmd}")
