"""The peers on an ImageFolder tree (``benchmarks.image_epoch``): each writes the tree with its own
writer and reads it back shuffled with its own loader, the same transform, batches of 32.

The tree's samples, in ImageFolder order (sorted class directories, sorted files): key
``NNNNNN`` (the sample's place in that order: the file names hold dots, which tar-based formats
split keys at), ``png`` (the file's bytes) and ``cls`` (the class index). Each peer as its docs set
an image dataset up:

- MosaicML Streaming: ``MDSWriter(columns={"key": "str", "png": "bytes", "cls": "int"})``;
  ``StreamingDataset(local=…, shuffle=True, batch_size=32)`` subclassed with a ``__getitem__``
  that applies the transform (its docs' way to transform samples), in a ``StreamingDataLoader``;
- LitData: ``optimize(fn, inputs=class directories, chunk_bytes="64MB", num_workers=2)``, ``fn``
  yielding one dict per image; ``StreamingDataset(dir, shuffle=True, transform=…)`` in a
  ``StreamingDataLoader``;
- Megatron-Energon: webdataset's ``ShardWriter`` (``key.png``, ``key.cls``; its docs' input)
  then ``energon prepare --sample-type CrudeWebdataset``; ``get_train_dataset(…,
  shuffle_buffer_size=1000, max_samples_per_sequence=100)`` with a task encoder whose cooker
  decodes and transforms, ``get_savable_loader``.

Every side's batch: ``(images [B, 3, 64, 64] float, labels LongTensor [B], keys)``. ``verify``
reads one epoch untransformed and returns (samples, unique keys, sum of crc32(png, label)).
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import zlib

PEERS = ("streaming", "litdata", "energon")
SIZE = (64, 64)


def to_tensor(img):
    """An RGB image resized, as torchvision's Resize + ToTensor make it: float C×H×W in [0, 1]."""
    import numpy as np
    import torch

    arr = np.array(img.resize(SIZE))  # a copy: writable, C-contiguous
    return torch.from_numpy(arr).permute(2, 0, 1).float().div_(255)


def tree_samples(tree: str, only: str | None = None):
    """(key, png bytes, class index) of every image, in ImageFolder's order; ``only``: one class's
    (its keys still numbered in the whole tree's order)."""
    classes = sorted(e.name for e in os.scandir(tree) if e.is_dir())
    i = 0
    for c, cls in enumerate(classes):
        paths = [
            os.path.join(d, n)
            for d, _, names in sorted(os.walk(os.path.join(tree, cls), followlinks=True))
            for n in sorted(names)
            if n.lower().endswith(".png")
        ]
        if only is not None and cls != only:
            i += len(paths)
            continue
        for path in paths:
            with open(path, "rb") as f:
                yield f"{i:06d}", f.read(), c
            i += 1


def checksum(png: bytes, label: int) -> int:
    return zlib.crc32(png, zlib.crc32(str(int(label)).encode()))


def expected(tree: str) -> tuple[int, int]:
    n = total = 0
    for _, png, c in tree_samples(tree):
        n += 1
        total += checksum(png, c)
    return n, total


# ---------------------------------------------------------------------- writers (untimed)
class _ClassDir:
    """optimize's fn: the images of one class directory as dicts."""

    def __init__(self, tree: str):
        self.tree = tree

    def __call__(self, cls: str):
        for key, png, c in tree_samples(self.tree, only=cls):
            yield {"key": key, "png": png, "cls": c}


def prepare(name: str, tree: str, out: str) -> None:
    if name == "streaming":
        from shardtool.benchmarks.peers import streaming

        mod = streaming.load()
        with mod.MDSWriter(out=out, columns={"key": "str", "png": "bytes", "cls": "int"}, size_limit="64mb") as w:
            for key, png, c in tree_samples(tree):
                w.write({"key": key, "png": png, "cls": c})
    elif name == "litdata":
        import litdata

        classes = sorted(e.name for e in os.scandir(tree) if e.is_dir())
        litdata.optimize(
            fn=_ClassDir(tree),
            inputs=classes,
            output_dir=out,
            chunk_bytes="64MB",
            num_workers=2,
            mode="overwrite",
            verbose=False,
        )
    elif name == "energon":
        import webdataset as wds

        os.makedirs(out, exist_ok=True)
        with wds.ShardWriter(os.path.join(out, "img-%05d.tar"), maxsize=64 << 20, verbose=0) as w:
            for key, png, c in tree_samples(tree):
                w.write({"__key__": key, "png": png, "cls": str(c).encode()})
        cli = os.path.join(os.path.dirname(sys.executable), "energon")
        subprocess.run(
            [cli, "prepare", out, "--non-interactive", "--force-overwrite", "--split-ratio", "1,0,0"]
            + ["--sample-type", "CrudeWebdataset", "--num-workers", "2", "--no-progress"],
            check=True,
            capture_output=True,
            timeout=600,
        )
    else:
        raise SystemExit(f"unknown peer {name}")


# ---------------------------------------------------------------------- readers
class _Transform:
    """A sample dict -> (image tensor, label, key); ``raw``: the PNG bytes kept (for verify)."""

    def __init__(self, raw: bool = False):
        self.raw = raw

    def __call__(self, d: dict):
        label = int(d["cls"]) if not isinstance(d["cls"], (bytes, bytearray)) else int(d["cls"].decode())
        if self.raw:
            return bytes(d["png"]), label, d["key"]
        from PIL import Image

        with Image.open(io.BytesIO(d["png"])) as img:
            return to_tensor(img.convert("RGB")), label, d["key"]


class _Collate:
    def __init__(self, raw: bool = False):
        self.raw = raw

    def __call__(self, rows):
        import torch

        images = [r[0] for r in rows] if self.raw else torch.stack([r[0] for r in rows])
        return images, torch.tensor([r[1] for r in rows], dtype=torch.long), [r[2] for r in rows]


_STREAMING = None


def _streaming_dataset_class():
    """StreamingDataset subclassed with a transform in ``__getitem__`` (its docs' pattern), made
    on first use so this module imports without Streaming; found by name from a spawned worker
    (its DataLoader spawns) through the module's ``__getattr__``."""
    global _STREAMING
    if _STREAMING is None:
        from shardtool.benchmarks.peers import streaming

        class StreamingTransformed(streaming.load().StreamingDataset):
            def __init__(self, *a, transform=None, **kw):
                super().__init__(*a, **kw)
                self.transform = transform

            def __getitem__(self, idx):
                return self.transform(super().__getitem__(idx))

        StreamingTransformed.__qualname__ = "StreamingTransformed"
        StreamingTransformed.__module__ = __name__
        _STREAMING = StreamingTransformed
    return _STREAMING


def __getattr__(name: str):
    if name == "StreamingTransformed":
        return _streaming_dataset_class()
    raise AttributeError(name)


def loader(name: str, out: str, workers: int, batch: int, raw: bool = False, seed: int = 0):
    tf, collate = _Transform(raw), _Collate(raw)
    if name == "streaming":
        from shardtool.benchmarks.peers import streaming

        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
        streaming.clean()
        ds = _streaming_dataset_class()(local=out, shuffle=True, shuffle_seed=seed, batch_size=batch, transform=tf)
        return streaming.load().StreamingDataLoader(
            ds, batch_size=batch, num_workers=workers, collate_fn=collate, persistent_workers=False
        )
    if name == "litdata":
        import litdata

        ds = litdata.StreamingDataset(out, shuffle=True, seed=seed, transform=tf)
        return litdata.StreamingDataLoader(ds, batch_size=batch, num_workers=workers, collate_fn=collate)
    if name == "energon":
        from shardtool.benchmarks.peers import energon

        return energon.loader(out, "images", workers, batch, seed, task_encoder=_energon_encoder()(tf, collate))
    raise SystemExit(f"unknown peer {name}")


_ENCODER = None


def _energon_encoder():
    global _ENCODER
    if _ENCODER is not None:
        return _ENCODER
    from dataclasses import dataclass

    from megatron.energon import Cooker, DefaultTaskEncoder, Sample, basic_sample_keys, stateless

    @dataclass
    class Item(Sample):
        item: object = None

    class Encoder(DefaultTaskEncoder):
        cookers = [Cooker(stateless(lambda raw: Item(**basic_sample_keys(raw), item=raw)))]  # noqa: RUF012
        decoder = None  # raw bytes: the transform decodes, as on every side

        def __init__(self, tf, collate):
            super().__init__()
            self.tf, self.collate = tf, collate

        def batch(self, samples):
            rows = []
            for s in samples:
                raw = s.item
                rows.append(self.tf({"key": s.__key__.rsplit("/", 1)[-1], "png": raw["png"], "cls": raw["cls"]}))
            return self.collate(rows)

        def encode_batch(self, batch):
            return batch

    _ENCODER = Encoder
    return Encoder


def verify(name: str, out: str, workers: int, batch: int) -> dict:
    keys: list[str] = []
    total = 0
    for pngs, labels, ks in loader(name, out, workers, batch, raw=True):
        keys += ks
        total += sum(checksum(p, int(c)) for p, c in zip(pngs, labels.tolist()))
    return {"samples": len(keys), "unique": len(set(keys)), "checksum": total}


def verify_ours(ds: str, workers: int, batch: int) -> dict:
    """Our loader's epoch untransformed: (samples, unique keys, sum of crc32(png, label))."""
    from shardtool.loader import ShardedLoader

    keys: list[str] = []
    total = 0
    for b in ShardedLoader(ds, batch_size=batch, num_workers=workers, pin_memory=False, metrics=False):
        keys += list(b["__key__"])
        total += sum(checksum(p, int(c)) for p, c in zip(b["png"], b["cls"].tolist()))
    return {"samples": len(keys), "unique": len(set(keys)), "checksum": total}


def peer_root(ds: str, name: str) -> str:
    return os.path.join(os.path.dirname(ds), f"peer-{name}")


def prepare_and_verify(
    tree: str, ds: str, peers: tuple[str, ...], batch: int, workers: tuple[int, ...] = (0, 2)
) -> dict:
    """Each peer's copy of the tree by its own writer (made once, untimed), then every side's
    whole epoch checked: samples, unique keys, sum of crc32(png, label) against the tree."""
    for name in peers:
        out = peer_root(ds, name)
        if not os.path.isdir(out):
            prepare(name, tree, out + ".tmp")
            os.rename(out + ".tmp", out)
    n, total = expected(tree)
    checked = {}
    for name in ("ours", *peers):
        for w in workers:
            got = verify_ours(ds, w, batch) if name == "ours" else verify(name, peer_root(ds, name), w, batch)
            if (got["samples"], got["unique"], got["checksum"]) != (n, n, total):
                raise SystemExit(
                    f"{name} w={w} read {got['samples']} images ({got['unique']} unique, checksum "
                    f"{'ok' if got['checksum'] == total else 'WRONG'}); the tree has {n}"
                )
            checked[f"{name}/w{w}"] = n
    return checked


def chosen(arg: str | None) -> tuple[str, ...]:
    """The peers to run: every one installed (None), none ('none'), or those named."""
    from shardtool.benchmarks.peers import available

    have = tuple(p for p in PEERS if p in available())
    peers = have if arg is None else tuple(x for x in arg.split(",") if x and x != "none")
    if set(peers) - set(have):
        raise SystemExit(f"peers not importable here: {sorted(set(peers) - set(have))} (benchmarks/setup_peers.sh)")
    return peers


def print_peers(rep: dict) -> None:
    print(
        f"verified before timing: every side read the whole tree at each worker count (count, unique keys, "
        f"crc32 of png + label): {', '.join(['ours', *rep['peers']])}"
    )
    print(f"{'workers':<8} {'side':<10} {'s (range)':<20} {'its time / ours (range)':<26} first batch s")
    for name, r in rep["runs"].items():
        for side in rep["peers"]:
            p = r[side]
            print(
                f"{name[1:]:<8} {side:<10} {p['seconds']:.2f} ({p['spread'][0]:.2f}-{p['spread'][1]:.2f}){'':<6}"
                f"{p['ratio']:.2f}x ({p['ratio_spread'][0]:.2f}-{p['ratio_spread'][1]:.2f}){'':<13}"
                f"{p['first_batch_s']:.2f}"
            )
