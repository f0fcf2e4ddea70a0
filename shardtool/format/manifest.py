"""The dataset manifest (``index.json``): the commit marker of a dataset.

It holds nothing time-dependent, so packing the same input twice gives the same manifest, and
its hash names a dataset version (the cache keys directories on it).
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import FormatError
from .fields import FieldSpec
from .hashing import hash_bytes

FORMAT_VERSION = 1
MANIFEST_NAME = "index.json"
LENGTHS_NAME = "lengths.npy"
SHARD_FORMATS = ("tar", "arrow")
COMPRESSIONS = ("zstd", "lz4")  # Arrow IPC buffer compression of arrow shards

# Length units (``length["unit"]``) that count what a batch pads: token ids or elements of the
# length field, characters, an integer length column, a user's --length-fn. A byte size (payload
# bytes: images, --per-file, file trees, or ``len`` of a raw field) pads nothing and is no measure
# of a sample's work: a larger PNG is not a larger image once decoded and resized.
PADDED_UNITS = ("tokens", "elements", "characters", "value", "fn")


def length_pads(length: Mapping[str, Any]) -> bool:
    """Whether a manifest's length definition counts what batches pad (not a byte size)."""
    return length.get("unit") in PADDED_UNITS


def require_packable(manifest: Manifest, where: str | None = None) -> None:
    """ValueError (``where: `` before it, if given) where packed rows cannot be made of this
    dataset (`unpackable`): the loader, a mixture's source and `shardtool plan` refuse alike."""
    refused = unpackable(manifest)
    if refused is not None:
        raise ValueError(f"{where}: {refused}" if where else refused)


def unpackable(manifest: Manifest) -> str | None:
    """Why packed rows cannot be made of this dataset; None where they can. Packing cuts each
    sample's token array, so the length must be the length of a field that decodes to an array
    (checked at the loader's construction and by `shardtool plan`, not at the first batch)."""
    length = manifest.length
    name = length.get("field")
    spec = next((f for f in manifest.fields if f.name == name), None)
    if name is None:
        unit = length.get("unit")
        what = "its payload's byte size, not a field's" if unit == "bytes" else f"a {unit} length, not a field's"
    elif spec is not None and spec.storage != "array" and spec.encoding != "npy":
        held = f"which holds {spec.storage} ({spec.encoding}), not token ids"
        taken = "the value" if length.get("unit") == "value" else "the length"
        what = f"{taken} of its field {name!r}, {held}"
    else:
        return None
    arrays = [f.name for f in manifest.fields if f.storage == "array" or f.encoding == "npy"]
    repack = f"--length {arrays[0]}" if len(arrays) == 1 else "--length FIELD"
    return (
        f"packed rows (seq_len=...) are cut from each sample's token array, and this dataset's length is {what}: "
        f"pack the token ids as a field and name it (shardtool pack {repack}, or --tokenizer with "
        "--text-field), or load it with batch_size= and no seq_len"
    )


def safe_relpath(path: str, what: str) -> str:
    """A manifest path must stay inside the dataset root."""
    if not isinstance(path, str) or not path:
        raise FormatError(f"{what}: empty path")
    if path.startswith("/") or "\\" in path or "\x00" in path or "://" in path:
        raise FormatError(f"{what}: path {path!r} is not relative to the dataset root")
    norm = posixpath.normpath(path)
    if norm.startswith("..") or norm == "." or ".." in norm.split("/"):
        raise FormatError(f"{what}: path {path!r} escapes the dataset root")
    return norm


def safe_source(source: str, what: str) -> str:
    """Where a shard held outside the dataset is read from (tars indexed in place): a URL
    (``s3://b/tars/x.tar``, ``file:///data/x.tar``) or a path relative to the dataset root, which
    may climb out of it (``../tars/x.tar``). Its bytes are checked against the shard's hash like
    any other shard's; ``path`` stays its name inside the dataset and every cache."""
    if not isinstance(source, str) or not source:
        raise FormatError(f"{what}: empty source")
    if "\\" in source or "\x00" in source or "\n" in source:
        raise FormatError(f"{what}: source {source!r} holds a backslash or control character")
    if "://" in source:
        return source
    if source.startswith("/"):
        raise FormatError(
            f"{what}: source {source!r} is absolute; give it relative to the dataset root or as a file:// URL"
        )
    norm = posixpath.normpath(source)
    if norm in (".", ".."):
        raise FormatError(f"{what}: source {source!r} names a directory")
    return norm


@dataclass(frozen=True)
class ShardInfo:
    path: str
    samples: int
    bytes: int
    hash: str
    index: str
    index_bytes: int
    index_hash: str
    # A compressed Arrow shard's size uncompressed (for the ratio `inspect` reports); absent
    # (None, and not written) for uncompressed shards, so their manifests are unchanged.
    raw_bytes: int | None = None
    # A shard the dataset does not hold (tars indexed in place, `shardtool index`): where its
    # bytes are (see safe_source); absent for shards under the dataset root at ``path``.
    source: str | None = None

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}

    @classmethod
    def from_dict(cls, d: dict, i: int) -> ShardInfo:
        try:
            info = cls(
                path=safe_relpath(d["path"], f"shard #{i}"),
                samples=int(d["samples"]),
                bytes=int(d["bytes"]),
                hash=str(d["hash"]),
                index=safe_relpath(d["index"], f"shard #{i} index"),
                index_bytes=int(d["index_bytes"]),
                index_hash=str(d["index_hash"]),
                raw_bytes=None if d.get("raw_bytes") is None else int(d["raw_bytes"]),
                source=None if d.get("source") is None else safe_source(d["source"], f"shard #{i} source"),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise FormatError(f"manifest shard #{i}: malformed entry ({e})") from None
        if info.samples < 0 or info.bytes < 0:
            raise FormatError(f"manifest shard #{i} ({info.path}): negative count")
        return info


def length_summary(lengths: np.ndarray) -> dict[str, Any]:
    if len(lengths) == 0:
        return {"count": 0, "total": 0}
    q = np.percentile(lengths, [50, 90, 99])
    return {
        "count": int(len(lengths)),
        "total": int(lengths.sum()),
        "min": int(lengths.min()),
        "p50": float(q[0]),
        "p90": float(q[1]),
        "p99": float(q[2]),
        "max": int(lengths.max()),
        "mean": float(lengths.mean()),
    }


@dataclass
class Manifest:
    shard_format: str
    fields: list[FieldSpec]
    shards: list[ShardInfo]
    length: dict[str, Any]  # {"field": name|None, "unit": str, "fn": "mod:func"|None, "summary": {...}}
    lengths_file: dict[str, Any] = field(default_factory=dict)  # {"path", "bytes", "hash"}
    extra: dict[str, Any] = field(default_factory=dict)
    compression: str | None = None  # arrow shards: the IPC buffer codec, or None

    @property
    def num_samples(self) -> int:
        return sum(s.samples for s in self.shards)

    @property
    def num_bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    @property
    def field_names(self) -> list[str]:
        return [f.name for f in self.fields]

    def field(self, name: str) -> FieldSpec:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"no field {name!r} (fields: {self.field_names})")

    def shard_offsets(self) -> np.ndarray:
        counts = np.array([s.samples for s in self.shards], dtype=np.int64)
        out = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=out[1:])
        return out

    def to_dict(self) -> dict:
        return {
            "shardtool": "dataset",
            "format_version": FORMAT_VERSION,
            "shard_format": self.shard_format,
            **({"compression": self.compression} if self.compression else {}),
            "num_samples": self.num_samples,
            "num_bytes": self.num_bytes,
            "fields": [f.to_dict() for f in self.fields],
            "length": self.length,
            "lengths": self.lengths_file,
            "shards": [s.to_dict() for s in self.shards],
            **({"extra": self.extra} if self.extra else {}),
        }

    def to_json(self) -> bytes:
        return (json.dumps(self.to_dict(), indent=1, sort_keys=False) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes, *, source: str = MANIFEST_NAME) -> Manifest:
        try:
            d = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise FormatError(f"{source}: not valid JSON ({e})") from None
        if not isinstance(d, dict) or d.get("shardtool") != "dataset":
            raise FormatError(f"{source}: not a shardtool manifest")
        version = d.get("format_version")
        if version != FORMAT_VERSION:
            raise FormatError(f"{source}: format_version {version!r} is not supported (expected {FORMAT_VERSION})")
        fmt = d.get("shard_format")
        if fmt not in SHARD_FORMATS:
            raise FormatError(f"{source}: unknown shard_format {fmt!r}")
        try:
            fields = [FieldSpec.from_dict(f) for f in d["fields"]]
            shards = [ShardInfo.from_dict(s, i) for i, s in enumerate(d["shards"])]
            m = cls(
                fmt,
                fields,
                shards,
                dict(d["length"]),
                dict(d.get("lengths") or {}),
                dict(d.get("extra") or {}),
                d.get("compression"),
            )
        except (KeyError, TypeError) as e:
            raise FormatError(f"{source}: missing or malformed entry {e}") from None
        if m.compression is not None and (fmt != "arrow" or m.compression not in COMPRESSIONS):
            raise FormatError(
                f"{source}: compression {m.compression!r} is not supported for {fmt} shards "
                f"(arrow shards: {', '.join(COMPRESSIONS)})"
            )
        if m.lengths_file:
            m.lengths_file["path"] = safe_relpath(m.lengths_file.get("path", ""), "lengths file")
        seen = set()
        for s in shards:
            if s.path in seen:
                raise FormatError(f"{source}: shard {s.path!r} listed twice")
            seen.add(s.path)
        if d.get("num_samples") is not None and int(d["num_samples"]) != m.num_samples:
            raise FormatError(
                f"{source}: num_samples {d['num_samples']} disagrees with the shards' sum {m.num_samples}"
            )
        return m


def check_length_summary(lengths: np.ndarray, summary: dict | None, *, source: str) -> None:
    """The lengths file must agree with the summary the manifest recorded when it was packed.

    Cheap (one pass over an int array), and it catches a lengths file replaced with its hash
    updated but its manifest's summary not: bucketing must never run on lengths nobody packed.
    """
    if not summary:
        return
    got = {"count": int(len(lengths)), "total": int(lengths.sum()) if len(lengths) else 0}
    if len(lengths):
        got.update(min=int(lengths.min()), max=int(lengths.max()))
    for k, v in got.items():
        if k in summary and int(summary[k]) != v:
            raise FormatError(
                f"{source}: lengths disagree with the manifest's length summary "
                f"({k} is {v}, manifest says {summary[k]})"
            )


def manifest_hash(data: bytes) -> str:
    """The dataset version: a hash of the manifest bytes exactly as stored."""
    return hash_bytes(data)


def lengths_to_bytes(lengths: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(lengths, dtype=np.int64), allow_pickle=False)
    return buf.getvalue()


def lengths_from_bytes(data: bytes, *, expected: int, source: str) -> np.ndarray:
    from .fields import npy_decode

    try:
        arr = npy_decode(data)
    except (ValueError, SyntaxError, KeyError) as e:
        raise FormatError(f"{source}: unreadable lengths file ({e})") from None
    if arr.ndim != 1 or arr.dtype.kind not in "iu" or len(arr) != expected:
        raise FormatError(f"{source}: expected {expected} integer lengths, found shape {arr.shape} {arr.dtype}")
    if len(arr) and int(arr.min()) < 0:
        raise FormatError(f"{source}: negative length")
    return arr.astype(np.int64, copy=False)
