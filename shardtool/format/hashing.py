"""Content hashes of shards and index files.

xxh3-128: non-cryptographic but collision-resistant enough to detect corruption, and it
hashes at >10 GB/s per core, so verifying every shard on warm/verify costs about what reading
it costs. The algorithm name is stored with the digest so it can change later.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:
    import mmap

ALGO = "xxh3_128"
CHUNK = 8 << 20


def new_hasher():
    return xxhash.xxh3_128()


def format_digest(h) -> str:
    return f"{ALGO}:{h.hexdigest()}"


def hash_bytes(data: bytes | bytearray | memoryview | mmap.mmap) -> str:
    h = new_hasher()
    h.update(data)
    return format_digest(h)


def hash_fileobj(f, chunk: int = CHUNK) -> tuple[str, int]:
    """Hash a readable binary file object from its current position; returns (digest, bytes)."""
    h = new_hasher()
    n = 0
    while True:
        block = f.read(chunk)
        if not block:
            break
        h.update(block)
        n += len(block)
    return format_digest(h), n


def hash_file(path: str) -> tuple[str, int]:
    with open(path, "rb") as f:
        return hash_fileobj(f)


def check_algo(digest: str) -> None:
    algo = digest.split(":", 1)[0]
    if algo != ALGO:
        from .errors import FormatError

        raise FormatError(f"unsupported hash algorithm {algo!r} (this shardtool knows {ALGO!r})")


def range_checksum(data) -> int:
    """The per-sample checksum stored in the sample index (xxh3-64 of the sample's byte range)."""
    return xxhash.xxh3_64_intdigest(data)
