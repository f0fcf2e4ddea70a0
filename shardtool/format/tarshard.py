"""Tar shards: WebDataset-compatible, byte-deterministic, with known member offsets.

We write POSIX ustar headers by hand rather than through ``tarfile``: it is several times
faster per member, and it lets us fix every header field (mtime 0, uid/gid 0, mode 0644, empty
user names) so the same samples always give the same bytes. Names over 100 bytes use a PAX
``path`` record, which webdataset's reader (Python's tarfile) understands.
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO

import numpy as np

from .errors import BadSampleError, FormatError
from .keys import member_name_problem

BLOCK = 512
_MAX_OCTAL_SIZE = 8**11 - 1
# Foreign tar members larger than this are refused before anything is read: a declared size is
# attacker-controlled, and we hold one member in memory at a time.
DEFAULT_MAX_MEMBER_BYTES = 4 << 30


def _pad(n: int) -> int:
    return (BLOCK - n % BLOCK) % BLOCK


def _octal(value: int, width: int) -> bytes:
    return b"%0*o\x00" % (width - 1, value)


def _header_slow(name: bytes, size: int, typeflag: bytes) -> bytes:
    h = bytearray(BLOCK)
    h[0 : len(name)] = name
    h[100:108] = b"0000644\x00"
    h[108:116] = b"0000000\x00"
    h[116:124] = b"0000000\x00"
    h[124:136] = _octal(size, 12)
    h[136:148] = b"00000000000\x00"
    h[148:156] = b"        "
    h[156:157] = typeflag
    h[257:263] = b"ustar\x00"
    h[263:265] = b"00"
    checksum = sum(h)
    h[148:156] = b"%06o\x00 " % checksum
    return bytes(h)


# Every header field but name, size, checksum and type is constant, so the checksum is a
# constant plus the sums of those few bytes: building a header costs a few short concatenations
# instead of summing 512 bytes (this is on the per-member hot path of every pack).
_MODE_IDS = b"0000644\x00" + b"0000000\x00" + b"0000000\x00"
_MTIME = b"00000000000\x00"
_TAIL = b"\x00" * 100 + b"ustar\x00" + b"00" + b"\x00" * (BLOCK - 265)
_CONST_SUM = sum(_MODE_IDS) + sum(_MTIME) + sum(_TAIL) + 8 * 32


def _header(name: bytes, size: int, typeflag: bytes) -> bytes:
    size_field = b"%011o\x00" % size
    checksum = _CONST_SUM + sum(name) + sum(size_field) + typeflag[0]
    return b"".join(
        (name, b"\x00" * (100 - len(name)), _MODE_IDS, size_field, _MTIME, b"%06o\x00 " % checksum, typeflag, _TAIL)
    )


# A whole batch of headers at once (the columnar packer's path): the same bytes as ``_header``,
# built as rows of one array so the per-member cost is a few vectorised operations.
_TEMPLATE = np.frombuffer(b"\x00" * 100 + _MODE_IDS + b"\x00" * 12 + _MTIME + b" " * 8 + b"0" + _TAIL, dtype=np.uint8)
_SIZE_SHIFTS = np.arange(30, -1, -3, dtype=np.int64)  # 11 octal digits, most significant first
_SUM_SHIFTS = np.arange(15, -1, -3, dtype=np.int64)  # 6 octal digits


def headers_batch(names: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """ustar headers of regular members: ``names`` (n, L ≤ 100) uint8, ``sizes`` (n,) < 8 GiB.

    Row ``i`` equals ``_header(names[i], sizes[i], b"0")``.
    """
    n, width = names.shape
    h = np.empty((n, BLOCK), dtype=np.uint8)
    h[:] = _TEMPLATE
    h[:, :width] = names
    digits = ((sizes.astype(np.int64)[:, None] >> _SIZE_SHIFTS) & 7) + 48
    h[:, 124:135] = digits
    h[:, 135] = 0
    checksum = _CONST_SUM + ord("0") + names.sum(axis=1, dtype=np.int64) + digits.sum(axis=1)
    h[:, 148:154] = ((checksum[:, None] >> _SUM_SHIFTS) & 7) + 48
    h[:, 154] = 0
    h[:, 155] = 32
    return h


def member_bytes(name: str, payload: bytes) -> tuple[bytes, int]:
    """All bytes of one member (header(s), payload, padding) and the payload's offset in them."""
    size = len(payload)
    if size > _MAX_OCTAL_SIZE:
        raise BadSampleError(f"member {name!r} is {size} bytes; tar members are limited to 8 GiB")
    bname = name.encode("utf-8")
    prefix = b""
    if len(bname) > 100:
        record_body = b" path=" + bname + b"\n"
        # The record's length field counts its own digits.
        n = len(record_body) + 1
        while len(str(n)) + len(record_body) != n:
            n = len(str(n)) + len(record_body)
        record = str(n).encode() + record_body
        prefix = _header(b"././@PaxHeader", len(record), b"x") + record + b"\x00" * _pad(len(record))
        bname = bname[:100]
    head = prefix + _header(bname, size, b"0")
    return head + payload + b"\x00" * _pad(size), len(head)


@dataclass
class TarSampleEntry:
    offset: int
    size: int
    field_offsets: list[int] = field(default_factory=list)  # relative to the sample start
    field_sizes: list[int] = field(default_factory=list)


_PADS = [b"\x00" * n for n in range(BLOCK)]


class TarShardWriter:
    """Appends samples to an open binary file; members of a sample are in field order."""

    def __init__(self, f: IO[bytes], exts: list[str]):
        self.f = f
        self.exts = exts
        self.pos = 0

    def write(self, key: str, payloads: list[bytes]) -> TarSampleEntry:
        offset, size, offs, sizes = self.write_fast(key, payloads)
        return TarSampleEntry(offset, size, offs, sizes)

    def write_fast(self, key: str, payloads: list[bytes]) -> tuple[int, int, list[int], list[int]]:
        """Like :meth:`write`, returning (offset, size, field_offsets, field_sizes) as a tuple."""
        parts = []
        offs = []
        sizes = []
        rel = 0
        for ext, payload in zip(self.exts, payloads):
            name = f"{key}.{ext}".encode()
            size = len(payload)
            if len(name) <= 100 and size <= _MAX_OCTAL_SIZE:
                pad = -size % BLOCK
                parts.append(_header(name, size, b"0"))
                parts.append(payload)
                if pad:
                    parts.append(_PADS[pad])
                offs.append(rel + BLOCK)
                rel += BLOCK + size + pad
            else:
                data, head = member_bytes(f"{key}.{ext}", payload)
                parts.append(data)
                offs.append(rel + head)
                rel += len(data)
            sizes.append(size)
        self.f.write(b"".join(parts))
        offset = self.pos
        self.pos += rel
        return offset, rel, offs, sizes

    def write_block(self, data) -> int:
        """Append whole members laid out by the caller (block-aligned); returns their offset."""
        offset = self.pos
        self.f.write(data)
        self.pos += len(data)
        return offset

    def close(self) -> None:
        self.f.write(b"\x00" * (2 * BLOCK))
        self.pos += 2 * BLOCK


def split_member_name(name: str) -> tuple[str, str]:
    """WebDataset's rule: key is everything before the first '.' of the basename."""
    directory, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    if not dot or not stem:
        raise ValueError(f"member {name!r} has no '<key>.<field>' form")
    return (directory + "/" + stem) if directory else stem, ext


def iter_tar_members(
    fileobj: IO[bytes], source: str, *, max_member_bytes: int = DEFAULT_MAX_MEMBER_BYTES, on_bad=None
) -> Iterator[tuple[str, bytes]]:
    """Stream (name, payload) of the regular-file members of a foreign tar, safely.

    Nothing is extracted to disk. Links, devices, FIFOs, absolute or '..' paths and members
    declaring more than ``max_member_bytes`` are refused with an error naming the member, before
    their payload is read. Directories are skipped. With ``on_bad`` (a callable taking the
    :class:`BadSampleError`), a refused member is reported to it and skipped instead of raising;
    a corrupt or truncated archive still raises.
    """

    def refuse(err: BadSampleError) -> None:
        if on_bad is None:
            raise err
        on_bad(err)

    try:
        tf = tarfile.open(fileobj=fileobj, mode="r|*")
    except tarfile.TarError as e:
        raise BadSampleError(f"not a readable tar archive ({e})", source=source) from None
    with tf:
        index = 0
        while True:
            try:
                info = tf.next()
            except tarfile.TarError as e:
                raise BadSampleError(f"corrupt tar after member #{index} ({e})", source=source) from None
            if info is None:
                return
            index += 1
            where = f"member #{index} {info.name!r}"
            if info.isdir():
                continue
            problem = member_name_problem(info.name)
            if problem:
                refuse(BadSampleError(problem, source=source, position=where))
                continue
            if info.issym() or info.islnk():
                refuse(BadSampleError(f"link member (to {info.linkname!r}) refused", source=source, position=where))
                continue
            if not info.isreg():
                refuse(BadSampleError("special file member (device/FIFO) refused", source=source, position=where))
                continue
            if info.size > max_member_bytes:
                refuse(
                    BadSampleError(
                        f"member declares {info.size} bytes, over the {max_member_bytes}-byte limit",
                        source=source,
                        position=where,
                    )
                )
                continue
            member = tf.extractfile(info)
            if member is None:  # pragma: no cover - regular files always have a payload
                raise BadSampleError("member has no payload", source=source, position=where)
            data = member.read()
            if len(data) != info.size:
                raise BadSampleError(f"truncated: read {len(data)} of {info.size} bytes", source=source, position=where)
            yield info.name, data


def check_sample_range(data: bytes, key: str, exts: list[str], offsets, sizes, shard: str) -> None:
    """Cheap guard that an indexed byte range really holds this sample (used by verify)."""
    for ext, off, size in zip(exts, offsets, sizes):
        head_start = off - BLOCK
        if head_start < 0 or off + size > len(data):
            raise FormatError(f"{shard}: sample {key!r} field {ext!r}: index points outside the sample range")
        header = data[head_start : head_start + BLOCK]
        name = header[:100].split(b"\x00", 1)[0].decode("utf-8", "replace")
        prefix = header[345:500].split(b"\x00", 1)[0] if header[257:262] == b"ustar" else b""
        if prefix:
            name = prefix.decode("utf-8", "replace") + "/" + name
        expected = f"{key}.{ext}"
        # A tar indexed in place keeps its own names: dir/stem.ext is key dir__stem (as pack
        # keys it), and a long name's header may hold a cut or GNU-mangled form of it.
        spelled = name.replace("/", "__")
        if (
            name != expected[:100]
            and spelled != expected
            and not (len(name) >= 99 and expected.startswith(spelled[:50]))
        ):
            raise FormatError(f"{shard}: sample {key!r}: expected member {expected!r}, found {name!r}")
        declared = int(header[124:136].rstrip(b"\x00 ") or b"0", 8)
        if declared != size:
            raise FormatError(f"{shard}: member {expected!r} declares {declared} bytes, index says {size}")
