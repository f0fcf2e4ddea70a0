"""Running a function as another (unprivileged) user, for tests of caches shared between users.

The function runs in a forked child that drops to ``uid``/``gid`` before calling it, so it sees
exactly what that user's job would: no root bypass of file permissions. A fork, not a new
interpreter: the interpreter may live where the other user cannot read it (say under /root), so
everything the function needs is imported before the fork (``preload``). Returns what the
function returns (picklable); re-raises its error as ``ChildFailed`` with the child's traceback.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import tempfile
import traceback

from helpers.skips import needs_root

NOBODY = 65534


class ChildFailed(AssertionError):
    """The function raised in the child; the message carries the type, text and traceback."""


def require_root() -> None:
    """Two real users need root to create the second one's process; elsewhere the test is skipped
    (CI runs as root, and treats this skip as a failure: tests/helpers/skips.py)."""
    needs_root("the test warms a cache as root and reads it as another user (uid 65534)")


def shared_tmpdir(prefix: str) -> str:
    """A directory every user can enter (pytest's tmp_path is 0700, so another user cannot)."""
    d = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    os.chmod(d, 0o755)
    return d


def make_readable(root: str) -> None:
    """Let every user read ``root``: the test's source dataset, whatever mode its writer chose."""
    for d, dirs, files in os.walk(root):
        os.chmod(d, 0o755)
        for f in files:
            os.chmod(os.path.join(d, f), 0o644)


def preload(*modules: str) -> None:
    for m in modules:
        importlib.import_module(m)


def run_as(
    fn,
    *args,
    uid: int = NOBODY,
    gid: int = NOBODY,
    groups: tuple[int, ...] = (),
    env: dict | None = None,
    timeout: float = 120,
):
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)

    def child():
        try:
            os.setgroups(list(groups))
            os.setgid(gid)
            os.setuid(uid)
            os.environ.update(env or {})
            out = ("ok", fn(*args))
        except BaseException as e:  # sent to the parent, which fails the test with it
            out = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        send.send(out)
        send.close()

    p = ctx.Process(target=child, daemon=True)
    p.start()
    send.close()
    try:
        if not recv.poll(timeout):
            raise AssertionError(f"{fn.__name__} as uid {uid} did not finish within {timeout}s (hung)")
        try:
            status, value = recv.recv()
        except EOFError:
            p.join(5)
            raise AssertionError(f"{fn.__name__} as uid {uid} died (exit code {p.exitcode})") from None
    finally:
        if p.is_alive():
            p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)
    if status != "ok":
        raise ChildFailed(f"{fn.__name__} as uid {uid} failed: {value}")
    return value
