"""Real data on this machine, for tests that must see what users feed us: the Adwaita icon theme's
PNGs as an ImageFolder tree (one class per icon category; names like ``x-symbolic.symbolic.png``)."""

from __future__ import annotations

import os

from helpers.skips import require

ICONS = "/usr/share/icons/Adwaita/48x48"
# Categories with enough icons to be classes; their sorted order is the label order.
ICON_CLASSES = ("actions", "devices", "legacy", "status")


def icon_tree(dst, per_class: int | None = None, classes=ICON_CLASSES) -> dict[str, list[str]]:
    """``dst/<category>/<icon>.png`` as symbolic links to the real icons (the first ``per_class``
    of each category by name, or all); returns class -> the file names linked. Skips the test
    when the icon theme is not installed (tests/run.sh installs it; under CI's strict mode a
    missing theme fails)."""
    require(
        os.path.isdir(ICONS), f"real PNG icons not installed ({ICONS} is absent; apt-get install adwaita-icon-theme)"
    )
    made: dict[str, list[str]] = {}
    for cls in classes:
        names = sorted(n for n in os.listdir(os.path.join(ICONS, cls)) if n.endswith(".png"))[:per_class]
        os.makedirs(os.path.join(dst, cls), exist_ok=True)
        for n in names:
            os.symlink(os.path.join(ICONS, cls, n), os.path.join(dst, cls, n))
        made[cls] = names
    return made


def icon_text_lengths(sides: tuple[int, ...] = (512, 256), patch: int = 14, cap: int = 576):
    """Image-text documents' token counts from the real icons of ``sides`` pixels: an image's
    placeholders as packing reserves them (ceil(w / patch) * ceil(h / patch), at most ``cap``,
    its size read from the PNG header) and a caption of its file name's words. At 512 pixels
    these are just over half a row of 1,024, the shape where documents cannot share rows."""
    import math
    import struct

    import numpy as np

    root = os.path.dirname(ICONS)
    out = []
    for side in sides:
        folder = os.path.join(root, f"{side}x{side}")
        require(os.path.isdir(folder), f"real PNG icons of {side} pixels not installed ({folder} is absent)")
        for cat in sorted(os.listdir(folder)):
            for name in sorted(n for n in os.listdir(os.path.join(folder, cat)) if n.endswith(".png")):
                with open(os.path.join(folder, cat, name), "rb") as f:
                    w, h = struct.unpack(">II", f.read(24)[16:24])
                words = name.split(".")[0].split("-")
                out.append(min(math.ceil(w / patch) * math.ceil(h / patch), cap) + len(words) + 2)
    return np.asarray(out, dtype=np.int64)
