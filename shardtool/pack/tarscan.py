"""Reading one existing WebDataset tar for ``shardtool index``: its sample index and whole-file hash,
in one sequential pass, without rewriting it.

Headers are parsed here, not by ``tarfile``: we need every member's byte offset, and only the
header blocks (plus the payloads a length is read from) are looked at. The whole-file hash is
fed sample by sample as the scan moves forward, so a tar larger than the page cache is still
read from disk once. The safety rules are those of packing a tar (``iter_tar_members``): no
links or special files, no absolute or ``..`` names, no member over the size limit; keys are
made as pack makes them (``dir/stem.ext`` → ``dir__stem``). Any breach is a
:class:`BadSampleError` naming the tar and the member: a tar is indexed whole or not at all.
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..format.errors import BadSampleError
from ..format.fields import FieldSpec, length_of
from ..format.hashing import format_digest, new_hasher, range_checksum
from ..format.keys import key_problem, member_name_problem
from ..format.tarshard import BLOCK, split_member_name
from .units import tree_key

_ZERO = bytes(BLOCK)
_REGULAR = (b"0", b"\x00", b"7")


@dataclass
class LengthRule:
    """How a sample's length is found: a field as pack's ``--length`` reads it, one key of a JSON
    member (``json:num_tokens``), a function of the sample, or (none of them) its payload bytes."""

    field: str | None = None
    json_key: str | None = None
    fn: Callable[[dict], Any] | None = None

    @classmethod
    def parse(cls, spec: str | None, fn=None) -> LengthRule:
        if spec is None:
            return cls(fn=fn)
        name, colon, key = spec.partition(":")
        return cls(name, key if colon else None)

    def of(self, key: str, exts: list[str], payloads: list, source: str, where: str) -> int:
        if self.field is not None:
            if self.field not in exts:
                raise BadSampleError(
                    f"sample {key!r} has no field {self.field!r} to read its length from", source=source, position=where
                )
            data = bytes(payloads[exts.index(self.field)])
            try:
                if self.json_key is None:
                    return length_of(FieldSpec.raw(self.field), data)
                value = json.loads(data)[self.json_key]
                return length_of(FieldSpec(self.field, self.field, "json", "json"), value)
            except (ValueError, TypeError, KeyError) as e:
                what = f"{self.field}:{self.json_key}" if self.json_key else self.field
                raise BadSampleError(
                    f"no length in {what} ({type(e).__name__}: {e})", source=source, position=where
                ) from None
        if self.fn is not None:
            sample = {"__key__": key, **{e: bytes(p) for e, p in zip(exts, payloads)}}
            try:
                n = self.fn(sample)
            except (KeyboardInterrupt, MemoryError, SystemExit):
                raise
            except Exception as e:
                raise BadSampleError(
                    f"length function failed ({type(e).__name__}: {e})", source=source, position=where
                ) from None
            if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n < 0:
                raise BadSampleError(f"length function returned {n!r}, not a length ≥ 0", source=source, position=where)
            return int(n)
        return sum(len(p) for p in payloads)


@dataclass
class TarScan:
    """One tar's sample index (fields in ``exts`` order), hash and size."""

    source: str
    bytes: int
    hash: str
    exts: list[str]
    keys: list[str] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    field_offsets: list[list[int]] = field(default_factory=list)
    field_sizes: list[list[int]] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    checksums: list[int] = field(default_factory=list)


def _octal(raw: bytes, source: str, where: str) -> int:
    if raw[:1] in (b"\x80", b"\xff"):  # GNU base-256 for sizes of 8 GiB and more
        n = int.from_bytes(raw[1:], "big")
        return -n if raw[:1] == b"\xff" else n
    text = raw.rstrip(b"\x00 ").lstrip(b" ")
    try:
        return int(text or b"0", 8)
    except ValueError:
        raise BadSampleError(f"corrupt tar header (size field {raw!r})", source=source, position=where) from None


def _pax_path(data: bytes, source: str, where: str) -> tuple[str | None, int | None]:
    """The ``path`` and ``size`` records of a PAX extended header."""
    path = size = None
    pos = 0
    while pos < len(data):
        sp = data.find(b" ", pos)
        try:
            n = int(data[pos:sp])
        except ValueError:
            raise BadSampleError("corrupt PAX header", source=source, position=where) from None
        rec = data[sp + 1 : pos + n - 1]
        k, _, v = rec.partition(b"=")
        if k == b"path":
            path = v.decode("utf-8", "surrogateescape")
        elif k == b"size":
            size = int(v)
        if n <= 0:
            raise BadSampleError("corrupt PAX header", source=source, position=where)
        pos += n
    return path, size


def open_bytes(path: str, fs=None):
    """The tar's bytes: a read-only memory map of a local file; a remote object is read whole
    (one shard in memory per worker)."""
    if fs is None or "file" in (fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)):
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            return mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else b""
        finally:
            os.close(fd)
    return fs.cat_file(path)


def scan_tar(path: str, *, source: str, max_member_bytes: int, length: LengthRule, fs=None) -> TarScan:
    try:
        data = open_bytes(path, fs)
    except FileNotFoundError:
        raise BadSampleError("tar does not exist", source=source) from None
    except OSError as e:
        raise BadSampleError(f"cannot read tar ({e})", source=source) from None
    view = memoryview(data)
    try:
        return _scan(view, source, max_member_bytes, length)
    finally:
        view.release()
        if isinstance(data, mmap.mmap):
            data.close()


def _scan(view: memoryview, source: str, max_member: int, length: LengthRule) -> TarScan:
    n = len(view)
    hasher = new_hasher()
    hashed = 0
    out = TarScan(source, n, "", [])
    exts: list[str] | None = None
    seen: set[str] = set()
    cur_key: str | None = None
    cur: dict[str, tuple[int, int]] = {}  # ext -> (payload offset, size)
    cur_start = cur_end = 0
    first_member = ""

    def close_sample(key: str) -> None:
        nonlocal exts, hashed
        where = f"sample {key!r} (member {first_member!r})"
        names = sorted(cur)
        if exts is None:
            exts = names
            out.exts = names
        elif names != exts:
            raise BadSampleError(
                f"sample {key!r} has fields {names}, the tar's first sample has {exts}",
                source=source,
                position=where,
            )
        if key in seen:
            raise BadSampleError(f"duplicate key {key!r}", source=source, position=where)
        seen.add(key)
        size = cur_end - cur_start
        if size >= 1 << 32:
            raise BadSampleError(
                f"sample of {size} bytes: members of one sample must lie within 4 GiB", source=source, position=where
            )
        out.keys.append(key)
        out.offsets.append(cur_start)
        out.sizes.append(size)
        out.field_offsets.append([cur[e][0] - cur_start for e in exts])
        out.field_sizes.append([cur[e][1] for e in exts])
        out.checksums.append(range_checksum(view[cur_start:cur_end]))
        out.lengths.append(length.of(key, exts, [view[cur[e][0] : cur[e][0] + cur[e][1]] for e in exts], source, where))
        hasher.update(view[hashed:cur_end])
        hashed = cur_end

    pos, index = 0, 0
    long_name: str | None = None
    long_size: int | None = None
    ext_start: int | None = None
    while pos + BLOCK <= n:
        header = bytes(view[pos : pos + BLOCK])
        if header == _ZERO:
            break
        index += 1
        where = f"member #{index} at offset {pos}"
        stored = _octal(header[148:156], source, where)
        if stored != sum(header) - sum(header[148:156]) + 256:  # the checksum field counts as spaces
            raise BadSampleError(
                "corrupt tar header (checksum mismatch): not a tar, or damaged", source=source, position=where
            )
        typeflag = header[156:157]
        size = _octal(header[124:136], source, where)
        if long_size is not None:
            size, long_size = long_size, None
        start = pos + BLOCK
        end = start + size + (-size % BLOCK)
        if size < 0 or start + size > n:
            raise BadSampleError(
                f"truncated: member declares {size} bytes, the tar ends first", source=source, position=where
            )
        if typeflag in (b"x", b"L", b"g", b"K"):
            if size > 1 << 20:
                raise BadSampleError(f"extended header of {size} bytes refused", source=source, position=where)
            if ext_start is None:
                ext_start = pos
            body = bytes(view[start : start + size])
            if typeflag == b"x":
                long_name, long_size = _pax_path(body, source, where)
            elif typeflag == b"L":
                long_name = body.rstrip(b"\x00").decode("utf-8", "surrogateescape")
            pos = end
            continue
        member_start = pos if ext_start is None else ext_start
        ext_start = None
        if long_name is not None:
            name, long_name = long_name, None
        else:
            name = header[:100].split(b"\x00", 1)[0].decode("utf-8", "surrogateescape")
            prefix = header[345:500].split(b"\x00", 1)[0] if header[257:262] == b"ustar" else b""
            if prefix:
                name = prefix.decode("utf-8", "surrogateescape") + "/" + name
        where = f"member #{index} {name!r}"
        pos = end
        if typeflag == b"5":
            continue
        problem = member_name_problem(name)
        if problem is None:
            try:
                name.encode("utf-8")
            except UnicodeEncodeError:
                problem = "member name is not valid UTF-8"
        if problem:
            raise BadSampleError(problem, source=source, position=where)
        if typeflag in (b"1", b"2"):
            target = header[157:257].split(b"\x00", 1)[0].decode("utf-8", "replace")
            raise BadSampleError(f"link member (to {target!r}) refused", source=source, position=where)
        if typeflag not in _REGULAR:
            raise BadSampleError("special file member (device/FIFO) refused", source=source, position=where)
        if size > max_member:
            raise BadSampleError(
                f"member declares {size} bytes, over the {max_member}-byte limit", source=source, position=where
            )
        try:
            raw_key, ext = split_member_name(name)
        except ValueError as e:
            raise BadSampleError(str(e), source=source, position=where) from None
        directory, _, stem = raw_key.rpartition("/")
        key = tree_key(directory, stem)
        if key != cur_key:
            if cur_key is not None:
                close_sample(cur_key)
            problem = key_problem(key)
            if problem:
                raise BadSampleError(problem, source=source, position=where)
            cur_key, cur, cur_start, first_member = key, {}, member_start, name
        if ext in cur:
            raise BadSampleError(f"field {ext!r} appears twice in sample {key!r}", source=source, position=where)
        cur[ext] = (start, size)
        cur_end = end
    if pos + BLOCK > n and pos < n and view[pos:n].tobytes().strip(b"\x00"):
        raise BadSampleError(f"truncated: {n - pos} stray bytes after the last member", source=source)
    if long_name is not None or ext_start is not None:
        raise BadSampleError("truncated: the tar ends after an extended header", source=source)
    if cur_key is not None:
        close_sample(cur_key)
    hasher.update(view[hashed:n])
    out.hash = format_digest(hasher)
    return out
