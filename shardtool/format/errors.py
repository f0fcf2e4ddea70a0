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

    def __init__(self, message: str, *, source: str | None = None, position: str | None = None, lost: int | None = 1):
        self.source = source
        self.position = position
        # Samples a skip of it loses: one, the rows left in an unreadable unit, or None where a
        # source breaks off at a point past which its size is unknown (`shardtool.pack.skips`).
        self.lost = lost
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


def add_note(exc: BaseException, note: str) -> BaseException:
    """Attach ``note`` to ``exc`` (PEP 678) on every supported Python; returns ``exc``.

    Python 3.11+ has ``BaseException.add_note``. Before it, calling that would raise an
    AttributeError that hides the real error, and tracebacks do not print ``__notes__``; there the
    note is appended to ``__notes__`` (pytest and 3.11+ read it; it survives pickling to a parent
    process) and, when the message is a single string (every ShardtoolError, most others), to the
    message too, so ``str(exc)`` and the printed traceback show it. Exceptions with structured
    arguments (``OSError(errno, text)``) keep their arguments unchanged: only ``__notes__`` has it.
    """
    if not isinstance(note, str):
        raise TypeError(f"note must be a str, not {type(note).__name__}")
    native = getattr(exc, "add_note", None)
    if callable(native):
        native(note)
        return exc
    notes = getattr(exc, "__notes__", None)
    if not isinstance(notes, list):
        notes = []
        exc.__notes__ = notes  # type: ignore[attr-defined]  # Python 3.10: no __notes__ (PEP 678 is 3.11)
    notes.append(note)
    if len(exc.args) == 1 and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]}\n{note}",)
    return exc
