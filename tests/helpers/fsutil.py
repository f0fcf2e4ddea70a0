"""Test helpers for files on disk: damage one, list leftover temps, mount a small real tmpfs."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator

from helpers.skips import require
from shardtool.format.atomic import TMP_PREFIX


def flip_byte(path: str, at: int, mask: int = 0xFF) -> None:
    """Damage one byte of ``path`` in place: XOR the byte at offset ``at`` with ``mask``."""
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)[0]
        f.seek(at)
        f.write(bytes([b ^ mask]))


def temps(root) -> list[str]:
    """Every temp file (shardtool's temp prefix) under ``root``."""
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.startswith(TMP_PREFIX)]


@contextlib.contextmanager
def tmpfs(path, opts: str) -> Iterator:
    """A real tmpfs mounted at ``path`` with ``opts`` (e.g. "size=2m", "ro,size=1m") for the block;
    skips the test where mounting is not allowed (needs root or CAP_SYS_ADMIN; a failure in CI)."""
    os.makedirs(path, exist_ok=True)
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True, timeout=30
    )
    require(
        res.returncode == 0,
        f"cannot mount a tmpfs here ({res.stderr.strip() or res.returncode}); needs root or CAP_SYS_ADMIN",
    )
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)
