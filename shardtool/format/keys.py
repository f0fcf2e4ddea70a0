"""Sample keys: what is allowed, and why.

Keys become tar member names (``<key>.<ext>``), so a key must never be able to name a path
outside the shard's directory, and webdataset splits member names at the first dot, so a key
with a dot would be read back as a different key.
"""

from __future__ import annotations

MAX_KEY_BYTES = 200
# Said in ``shardtool pack --help`` and docs/packing.md.
KEY_RULES = (
    f"A sample key is non-empty UTF-8 of at most {MAX_KEY_BYTES} bytes without '/', '\\', '.', NUL, "
    "newline or other control characters: it becomes the tar member name KEY.FIELD, which must "
    "stay inside the shard's directory, and WebDataset reads everything after the first '.' as "
    "the field name."
)
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


def is_control(c: str) -> bool:
    """A control character (C0 or DEL), which a tar member name (a file name) must not hold."""
    return ord(c) < 32 or ord(c) == 127


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


# ---------------------------------------------------------------- keys from file paths
# One file = one sample (``pack --per-file``): the key spells the file's relative path.
_PATH_CHARS = {"/": "__", ".": "_", "\\": "_"}
_HASH_HEX = 8  # the suffix: "-" + 8 hex digits of a hash of the path


def path_key(rel: str) -> str:
    """A valid key spelling the '/'-separated relative path ``rel``: '/' becomes '__'; '.', '\\'
    and control characters become '_'; a key past the byte limit is cut and given a hash suffix.
    ``a/b.c/d.txt`` → ``a__b_c__d_txt``."""
    key = "".join(_PATH_CHARS.get(c) or ("_" if is_control(c) else c) for c in rel)
    if len(key.encode("utf-8")) > MAX_KEY_BYTES:
        key = _hashed(key, rel, _HASH_HEX)
    return key


def _hashed(key: str, rel: str, hex_digits: int) -> str:
    import hashlib

    digest = hashlib.blake2b(rel.encode("utf-8"), digest_size=hex_digits // 2).hexdigest()
    base = key.encode("utf-8")[: MAX_KEY_BYTES - hex_digits - 1].decode("utf-8", "ignore")
    return f"{base}-{digest}"


def keys_for_paths(rels: list[str]) -> list[str]:
    """Unique valid keys for distinct relative paths, a pure function of the whole list.

    Each path gets :func:`path_key`; the paths of any group that would share a key (``a.b`` and
    ``a_b``; ``a/b`` and ``a__b``) each get ``-`` + a hash of their own path instead, so which
    key a file gets does not depend on the order the paths are listed in.
    """
    keys = [path_key(r) for r in rels]
    for hex_digits in (_HASH_HEX, 16, 32):
        seen: dict[str, list[int]] = {}
        for i, k in enumerate(keys):
            seen.setdefault(k, []).append(i)
        clashing = [i for group in seen.values() if len(group) > 1 for i in group]
        if not clashing:
            return keys
        for i in clashing:
            keys[i] = _hashed(path_key(rels[i]), rels[i], hex_digits)
    raise ValueError("cannot give these paths unique keys (are some listed twice?)")
