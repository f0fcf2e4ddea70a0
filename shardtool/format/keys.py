"""Sample keys: what is allowed, and why.

Keys become tar member names (``<key>.<ext>``), so a key must never be able to name a path
outside the shard's directory, and webdataset splits member names at the first dot, so a key
with a dot would be read back as a different key.
"""
from __future__ import annotations

MAX_KEY_BYTES = 200
_FORBIDDEN = {"/": "a '/'", "\\": "a '\\'", "\x00": "a NUL byte", "\n": "a newline", "\r": "a carriage return"}


def key_problem(key: object) -> str | None:
    """Why ``key`` is not a valid sample key, or None if it is."""
    if isinstance(key, bytes):
        try:
            key = key.decode("utf-8")
        except UnicodeDecodeError:
            return "key is not valid UTF-8"
    if not isinstance(key, str):
        return f"key must be a string, got {type(key).__name__}"
    if not key:
        return "key is empty"
    for ch, what in _FORBIDDEN.items():
        if ch in key:
            return f"key {key!r} contains {what}"
    if ".." in key:
        return f"key {key!r} contains '..'"
    if "." in key:
        return f"key {key!r} contains '.', which webdataset would read as the start of the field name"
    if any(ord(c) < 32 for c in key):
        return f"key {key!r} contains a control character"
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError:
        return f"key {key!r} is not encodable as UTF-8"
    if size > MAX_KEY_BYTES:
        return f"key of {size} bytes is longer than the {MAX_KEY_BYTES}-byte limit"
    return None


def member_name_problem(name: str) -> str | None:
    """Why a tar member name (read from a foreign shard) must be refused, or None."""
    if not name:
        return "empty member name"
    if "\x00" in name:
        return "member name contains a NUL byte"
    if name.startswith("/") or name.startswith("\\") or (len(name) > 1 and name[1] == ":"):
        return f"absolute member path {name!r}"
    parts = name.replace("\\", "/").split("/")
    if ".." in parts:
        return f"member path {name!r} contains '..'"
    return None
