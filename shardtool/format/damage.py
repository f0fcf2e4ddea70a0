"""Checking a whole shard's bytes against the manifest, and naming the damage when they differ.

The whole-shard hash says only *that* a shard is bad; the per-sample checksums in its index say
*where*. Used by ``shardtool verify`` and by the loader before it serves a shard read in place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import FormatError
from .hashing import check_algo, hash_bytes, range_checksum

if TYPE_CHECKING:
    from .dataset import Dataset


def check_shard_bytes(ds: Dataset, shard: int, data) -> None:
    """Raise FormatError, naming the shard and its damaged samples, unless ``data`` (the whole
    shard: bytes, an mmap) has the size and content hash the manifest records."""
    info = ds.manifest.shards[shard]
    check_algo(info.hash)
    if len(data) != info.bytes:
        raise FormatError(f"{info.path}: {len(data)} bytes on disk, manifest says {info.bytes} (truncated?)")
    if hash_bytes(data) != info.hash:
        raise corrupt_shard_error(ds, shard, data)


def failing_samples(ds: Dataset, shard: int, data) -> list[tuple[int, str]] | None:
    """(index, key) of every sample whose byte range fails its index checksum; None when the
    index cannot say (no checksums, or the index itself is bad)."""
    try:
        idx = ds.shard_index(shard)
    except FormatError:
        return None
    if idx.checksums is None:
        return None
    bad: list[tuple[int, str]] = []
    verdict: dict[tuple[int, int], bool] = {}
    for i in range(len(idx)):
        off, size = int(idx.offsets[i]), int(idx.sizes[i])
        ok = verdict.get((off, size))  # Arrow rows of one record batch share a range: hash it once
        if ok is None:
            ok = verdict[(off, size)] = range_checksum(data[off : off + size]) == int(idx.checksums[i])
        if not ok:
            bad.append((i, idx.keys[i]))
    return bad


def corrupt_shard_error(ds: Dataset, shard: int, data) -> FormatError:
    """The whole-shard hash failed: name the damaged samples where the per-sample checksums can."""
    path = ds.manifest.shards[shard].path
    bad = failing_samples(ds, shard, data)
    where = ""
    if bad:
        runs: list[list[tuple[int, str]]] = []
        for i, key in bad:  # contiguous runs: an Arrow record batch fails as one range
            if runs and runs[-1][-1][0] == i - 1:
                runs[-1].append((i, key))
            else:
                runs.append([(i, key)])
        named = ", ".join(
            f"#{r[0][0]} ({r[0][1]!r})" if len(r) == 1 else f"#{r[0][0]}..#{r[-1][0]} ({r[0][1]!r}..{r[-1][1]!r})"
            for r in runs[:5]
        )
        more = f" and {len(runs) - 5} more runs" if len(runs) > 5 else ""
        where = f"; damaged sample{'s' if len(bad) > 1 else ''} {named}{more}"
    elif bad is not None:
        where = (
            "; every sample's bytes match their checksums, so the damage is outside them "
            "(tar end blocks or Arrow file metadata)"
        )
    err = FormatError(f"{path} of {ds.url}: content hash does not match the manifest (corrupted){where}")
    err.samples = [{"index": i, "key": key} for i, key in (bad or [])]  # type: ignore[attr-defined]  # this error only
    return err
