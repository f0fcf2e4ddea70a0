"""The loaders a team weighs against ours, each set up as its own docs recommend.

One module per peer (``streaming``: MosaicML Streaming, ``litdata``: Lightning's LitData,
``energon``: Megatron-Energon). Each is used only when its package imports (`available`), so
the benchmarks run with whichever peers are installed (``bash benchmarks/setup_peers.sh``
builds a venv with all three). Every peer module offers the same small interface:

- ``NAME``, ``version()``;
- ``prepare(src, out, kind, workers)``: the tar shards of our synthetic corpus (``src``) written
  in the peer's own format with its own writer (``MDSWriter``, ``litdata.optimize``, a
  ``ShardWriter`` copy + ``energon prepare``);
- ``loader(out, kind, workers, batch, seed, rank=0, world_size=1, state=None)``: its recommended
  shuffled reader, yielding the same batches as ours and webdataset's (``collate``);
- ``state_dict(loader, batches_seen)`` where the peer can resume, else ``None``.

Batches are dicts: ``__key__`` (list of str) and ``tokens`` (LongTensor [B, max len], zero
padded) + ``lengths``, or ``jpg`` (list of bytes) for the image-like corpus.
"""

from __future__ import annotations

import importlib
import io
import os
import tarfile
import zlib

import numpy as np

PEERS = ("streaming", "litdata", "energon")


def available() -> dict:
    """{name: module} of the peers whose package imports here (the others are left out, with why)."""
    out = {}
    for name in PEERS:
        try:
            mod = importlib.import_module(f"{__name__}.{name}")
            mod.version()  # imports the peer's package
        except ImportError:
            continue
        out[name] = mod
    return out


def missing() -> dict[str, str]:
    """{name: reason} for the peers that are not importable."""
    out = {}
    for name in PEERS:
        try:
            importlib.import_module(f"{__name__}.{name}").version()
        except ImportError as e:
            out[name] = f"not importable here: {e}"
    return out


def tar_samples(src: str, kind: str, shards: list[str] | None = None):
    """(key, payload) of every sample of the corpus' tar shards in order: int32 tokens or jpg bytes."""
    for path in shards or tar_paths(src):
        with tarfile.open(path) as tf:
            for m in tf:
                if not m.isfile():
                    continue
                key, _, ext = m.name.partition(".")
                data = tf.extractfile(m).read()
                if kind == "tokens" and ext == "tokens.npy":
                    yield key, np.load(io.BytesIO(data))
                elif kind == "images" and ext == "jpg":
                    yield key, data


def tar_paths(src: str) -> list[str]:
    return sorted(os.path.join(src, f) for f in os.listdir(src) if f.endswith(".tar"))


def pad(keys: list[str], arrays: list) -> dict:
    """The token batch every side delivers: keys, a zero-padded LongTensor and the lengths."""
    import torch

    counts = np.array([len(a) for a in arrays], dtype=np.int64)
    out = np.zeros((len(arrays), int(counts.max())), dtype=np.int64)
    for r, a in enumerate(arrays):
        out[r, : len(a)] = a
    return {"__key__": list(keys), "tokens": torch.from_numpy(out), "lengths": torch.from_numpy(counts)}


def checksum(key: str, payload) -> int:
    """An order-free fingerprint of one sample: crc32 of its key and payload bytes."""
    data = payload.tobytes() if hasattr(payload, "tobytes") else bytes(payload)
    return zlib.crc32(data, zlib.crc32(key.encode()))


def batch_fingerprint(batch: dict, kind: str) -> tuple[list[str], int]:
    """(keys, sum of checksums) of one delivered batch, the padding stripped."""
    keys, total = list(batch["__key__"]), 0
    for r, key in enumerate(keys):
        if kind == "tokens":
            payload = batch["tokens"][r, : int(batch["lengths"][r])].numpy().astype(np.int32)
        else:
            payload = batch["jpg"][r]
        total += checksum(key, payload)
    return keys, total


def expected(src: str, kind: str) -> tuple[int, int]:
    """(samples, sum of checksums) of the corpus, read straight from its tar shards."""
    n = total = 0
    for key, payload in tar_samples(src, kind):
        n += 1
        total += checksum(key, payload)
    return n, total
