"""The one size grammar of every size option (``--shard-size``, ``--max-bytes``, ``--min-free``, …).

``10G``/``10GB`` are powers of 1000 and ``10Gi``/``10GiB`` powers of 1024 (K, M, G, T, P),
case-insensitive; a plain number is bytes; a decimal point is allowed (``1.5G``).
"""

from __future__ import annotations

import re
from typing import overload

from .errors import ShardtoolError

__all__ = ["SizeError", "format_size", "parse_size"]

_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*(?:([kmgtp])(i?)b?|b)?\s*", re.IGNORECASE)
EXAMPLES = "examples: 262144, 500M, 500MB, 1.5G, 10Gi, 10GiB"


class SizeError(ShardtoolError, ValueError):
    """A size option that does not follow the size grammar."""


@overload
def parse_size(text: str | int, *, what: str = ..., positive: bool = ...) -> int: ...
@overload
def parse_size(text: None, *, what: str = ..., positive: bool = ...) -> None: ...
@overload
def parse_size(text: str | int | None, *, what: str = ..., positive: bool = ...) -> int | None: ...


def parse_size(text: str | int | None, *, what: str = "size", positive: bool = False) -> int | None:
    """``"1GiB"`` → 1073741824, ``"500MB"`` → 500000000, ``"10G"`` → 10**10, ``123`` → 123; None stays None.

    ``positive``: zero is refused too (a shard size of 0 bytes means nothing)."""
    if text is None:
        return None
    if isinstance(text, bool):
        raise SizeError(f"{what} must be a size, found {text!r} ({EXAMPLES})")
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE.fullmatch(str(text))
        if not m:
            raise SizeError(f"cannot read {what} {text!r} ({EXAMPLES})")
        unit, binary = (m.group(2) or "").lower(), bool(m.group(3))
        power = "kmgtp".index(unit) + 1 if unit else 0
        value = int(float(m.group(1)) * (1024 if binary else 1000) ** power)
    if value < 0 or (positive and value == 0):
        raise SizeError(f"{what} {text!r} must be {'positive' if positive else 'zero or more'}")
    return value


def format_size(n: float) -> str:
    """Bytes for people: ``512 B``, ``1.5 KiB``, ``3.2 GiB`` (powers of 1024, up to TiB)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} TiB"
