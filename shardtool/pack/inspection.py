"""``shardtool inspect``: what a dataset holds, from its manifest, plus a peek at one sample."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..format.dataset import open_dataset


def _short(v: Any, limit: int = 120) -> Any:
    if isinstance(v, np.ndarray):
        head = v[:8].tolist()
        return f"array({v.dtype}, len={len(v)}, head={head})"
    if isinstance(v, (bytes, bytearray, memoryview)):
        b = bytes(v)
        return f"{len(b)} bytes: {b[:32]!r}{'…' if len(b) > 32 else ''}"
    text = repr(v)
    return text if len(text) <= limit else text[:limit] + "…"


def inspect(url: str, *, storage_options: dict | None = None, peek: bool = True) -> dict:
    ds = open_dataset(url, storage_options=storage_options)
    m = ds.manifest
    counts = ds.shard_counts
    out = {
        "url": url,
        "version": ds.version,
        "shard_format": m.shard_format,
        "shards": len(m.shards),
        "samples": m.num_samples,
        "bytes": m.num_bytes,
        "samples_per_shard": {"min": int(counts.min()), "max": int(counts.max())} if len(counts) else {},
        "fields": [f.to_dict() for f in m.fields],
        "length": m.length,
    }
    if m.extra.get("classes"):  # an ImageFolder pack (--label-from-dir): field cls indexes these
        out["classes"] = list(m.extra["classes"])
    plain = m.num_bytes
    if m.compression:
        raw = plain = sum(s.raw_bytes if s.raw_bytes is not None else s.bytes for s in m.shards)
        out["compression"] = {
            "codec": m.compression,
            "uncompressed_bytes": raw,
            "ratio": raw / m.num_bytes if m.num_bytes else 1.0,
        }
    # What storage holds and what a node cache holds (compressed shards are decompressed into it).
    out["stored_bytes"] = m.num_bytes
    out["plain_bytes"] = plain
    if peek and m.num_samples:
        shard = int(np.flatnonzero(counts)[0])
        sample = ds.read(shard, 0)
        out["peek"] = {"shard": m.shards[shard].path, "sample": {k: _short(v) for k, v in sample.items()}}
    ds.close()
    return out


def render(info: dict) -> str:
    lines = [
        f"{info['url']}  ({info['shard_format']}, version {info['version']})",
        f"  samples {info['samples']:,} in {info['shards']} shards, {info['bytes'] / 1e6:,.1f} MB",
    ]
    comp = info.get("compression")
    if comp:
        lines.append(
            f"  compressed with {comp['codec']}: {comp['uncompressed_bytes'] / 1e6:,.1f} MB uncompressed, "
            f"ratio {comp['ratio']:.2f}x"
        )
        lines.append(
            f"  stored {info['stored_bytes'] / 1e6:,.1f} MB; in a node cache {info['plain_bytes'] / 1e6:,.1f} MB "
            "plain (warm decompresses; --keep-compressed keeps the stored size)"
        )
    sps = info.get("samples_per_shard")
    if sps:
        lines.append(f"  samples per shard {sps['min']:,}..{sps['max']:,}")
    lines.append(
        "  fields: "
        + ", ".join(
            f"{f['name']} ({f['storage']}{', ' + f['dtype'] if 'dtype' in f else ''} as .{f['ext']})"
            for f in info["fields"]
        )
    )
    classes = info.get("classes")
    if classes:
        shown = ", ".join(f"{i} {c}" for i, c in enumerate(classes[:12]))
        lines.append(f"  classes ({len(classes)}, the cls field's labels): {shown}{' …' if len(classes) > 12 else ''}")
    L = info["length"]
    what = L.get("field") or L.get("fn") or L.get("json") or "payload"
    s = L.get("summary", {})
    if s.get("count"):
        lines.append(
            f"  length = {what} [{L.get('unit')}]: total {s['total']:,}, min {s['min']}, p50 {s['p50']:g}, "
            f"p90 {s['p90']:g}, p99 {s['p99']:g}, max {s['max']}"
        )
    if "peek" in info:
        lines.append(f"  peek at {info['peek']['shard']} sample 0:")
        for k, v in info["peek"]["sample"].items():
            lines.append(f"    {k}: {v}")
    return "\n".join(lines)
