"""The image benchmark's corpus and its one transform: the Adwaita icons as an ImageFolder tree,
packed once, and the decode + resize that every side runs on it.

Apart from `image_epoch` (which times the sides) so that what is read, and how each image is
turned into a tensor, is one definition the timed runs and the breakdown share.
"""

from __future__ import annotations

import io
import os

from shardtool.benchmarks.peer_images import SIZE, to_tensor  # the one transform, shared with the peers

ICONS = "/usr/share/icons/Adwaita"
BATCH = 32


# ---------------------------------------------------------------------- corpus
def build_tree(dst: str, limit: int | None = None) -> int:
    """``dst/<category>/<size>-<icon>.png`` as links to every PNG of the icon theme (every
    ``len // limit``-th one with ``limit``, so every size and category stays); returns the count."""
    if not os.path.isdir(ICONS):
        raise SystemExit(
            f"{ICONS} is absent: this benchmark reads the real Adwaita PNG icons (apt-get install adwaita-icon-theme)"
        )
    n = seen = 0
    step = max(1, _count_pngs() // limit) if limit else 1
    for size in sorted(os.listdir(ICONS)):
        size_dir = os.path.join(ICONS, size)
        if not os.path.isdir(size_dir) or "x" not in size:  # 16x16 … 512x512, not cursors/ or scalable/
            continue
        for category in sorted(os.listdir(size_dir)):
            cat_dir = os.path.join(size_dir, category)
            for name in sorted(os.listdir(cat_dir)) if os.path.isdir(cat_dir) else []:
                seen += name.endswith(".png")
                if name.endswith(".png") and (seen - 1) % step == 0 and (limit is None or n < limit):
                    os.makedirs(os.path.join(dst, category), exist_ok=True)
                    os.symlink(os.path.join(cat_dir, name), os.path.join(dst, category, f"{size}-{name}"))
                    n += 1
    return n


def _count_pngs() -> int:
    return sum(n.endswith(".png") for d, _, names in os.walk(ICONS) for n in names if "x" in d.split("/")[-2])


def prepare(base: str, limit: int | None = None) -> tuple[str, str, int]:
    """(tree, packed dataset, images), made once under ``base``."""
    import shardtool

    tag = f"-{limit}" if limit else ""
    tree, ds = os.path.join(base, "tree" + tag), os.path.join(base, "ds" + tag)
    if not os.path.isdir(tree):
        build_tree(tree + ".tmp", limit)
        os.rename(tree + ".tmp", tree)
    if not os.path.exists(os.path.join(ds, "index.json")):
        shardtool.pack(tree, ds, label_from_dir=True, overwrite=True)
    return tree, ds, shardtool.open_dataset(ds).manifest.num_samples


# ---------------------------------------------------------------------- the one transform
def ours_transform(sample: dict) -> dict:
    from PIL import Image

    with Image.open(io.BytesIO(sample["png"])) as img:
        sample["png"] = to_tensor(img.convert("RGB"))  # what ImageFolder's pil_loader does before the transform
    return sample


def trivial_transform(sample: dict) -> dict:
    """Same output shape, no decode: what the loader itself costs."""
    import torch

    sample["png"] = torch.zeros(3, *SIZE)
    return sample


def peer_dataset(tree: str):
    """torchvision's ImageFolder with the transform, or the hand-written equivalent; (dataset, name)."""
    try:
        from torchvision.datasets import ImageFolder

        return ImageFolder(tree, transform=to_tensor), "torchvision ImageFolder"
    except Exception:  # not installed, or a CUDA wheel that a CPU torch cannot load
        return _Folder(tree), "ImageFolder-equivalent Dataset (torchvision not importable)"


class _Folder:
    """torchvision.datasets.ImageFolder's behaviour on this tree: sorted class directories, each
    class's files in sorted walk order, pil_loader, then the transform."""

    def __init__(self, root: str):
        self.classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
        self.samples = []
        for i, cls in enumerate(self.classes):
            for dirpath, _, names in sorted(os.walk(os.path.join(root, cls), followlinks=True)):
                self.samples += [(os.path.join(dirpath, n), i) for n in sorted(names) if n.lower().endswith(".png")]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        from PIL import Image

        path, target = self.samples[i]
        with open(path, "rb") as f:
            img = Image.open(f)
            return to_tensor(img.convert("RGB")), target
