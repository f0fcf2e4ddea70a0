"""A raw sample (field name -> stored bytes or Arrow value) decoded by its manifest's field specs."""

from __future__ import annotations

from typing import Any

from .arrowshard import KEY_COLUMN
from .fields import decode_bytes
from .manifest import Manifest

__all__ = ["decode_sample"]


def decode_sample(
    manifest: Manifest, raw: dict[str, Any], *, allow_pickle: bool = False, where: str = ""
) -> dict[str, Any]:
    out: dict[str, Any] = {KEY_COLUMN: raw[KEY_COLUMN]}
    tar = manifest.shard_format == "tar"
    for spec in manifest.fields:
        v = raw[spec.name]
        if tar or spec.storage == "raw":
            v = decode_bytes(spec.encoding, v, allow_pickle=allow_pickle, what=f"{where} field {spec.name!r}")
        out[spec.name] = v
    return out
