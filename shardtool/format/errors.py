"""Error types and the error policy.

Policy (read by pack, loader and cache alike):
- Bad *input* (a source file, a line, a member, a sample) raises :class:`BadSampleError`, which
  names the file and the position. ``--skip-bad`` turns exactly these into counted skips.
- A bad *dataset* (manifest, index, shard that disagrees with its manifest) raises
  :class:`FormatError` naming the shard; it is never skipped, because training on data that
  disagrees with its own index silently changes what the model sees.
- Anything else (``OSError``, ``MemoryError``, ``KeyboardInterrupt``) propagates unchanged: it
  is never turned into a skip.
"""
from __future__ import annotations


class ShardtoolError(Exception):
    """Base class of every error shardtool raises on purpose."""


class FormatError(ShardtoolError):
    """The dataset on disk is malformed or disagrees with its manifest."""


class BadSampleError(ShardtoolError):
    """One input sample cannot be packed; names where it came from."""

    def __init__(self, message: str, *, source: str | None = None, position: str | None = None):
        self.source = source
        self.position = position
        where = ""
        if source is not None:
            where = f"{source}"
            if position is not None:
                where += f" ({position})"
            where += ": "
        super().__init__(where + message)
        self.reason = message


class PickleRefusedError(FormatError):
    """A field is pickled and the caller did not opt into unpickling it."""
