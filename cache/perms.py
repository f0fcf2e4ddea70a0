"""Who may read a cache: the modes and group of everything the cache creates.

A node's cache is warmed by root (a SLURM prolog) and read by the job's user, so what the
cache writes must not inherit the writer's umask or a temp file's 0600: every file it creates
gets ``mode`` (0644 by default) and every directory that mode plus search permission wherever
it grants read (0755), optionally owned by ``group`` (``shardtool warm --mode 0640 --group
hpcusers``). The mode is set on the open descriptor before a file is renamed into place, so a
published file is never visible with other permissions, and a trust stamp (which records the
file's ctime) is written after it.
"""

from __future__ import annotations

import contextlib
import grp
import os
import stat
from dataclasses import dataclass


@dataclass(frozen=True)
class Perms:
    mode: int = 0o644  # files; directories add x wherever r is granted
    gid: int | None = None  # group of created files and directories (None: the creator's)

    @property
    def dir_mode(self) -> int:
        return self.mode | ((self.mode & 0o444) >> 2)

    def set_fd(self, fd: int) -> None:
        """Give a file this process just created (or owns) the cache's mode and group."""
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            return  # someone else's file: theirs to set, and fchmod would fail
        if self.gid is not None and st.st_gid != self.gid:
            os.fchown(fd, -1, self.gid)
        if stat.S_IMODE(st.st_mode) != self.mode:
            os.fchmod(fd, self.mode)  # after fchown, which may clear setgid bits

    def set_dir(self, path: str) -> None:
        if self.gid is not None:
            os.chown(path, -1, self.gid)
        os.chmod(path, self.dir_mode)

    def makedirs(self, path: str) -> None:
        """``os.makedirs(path, exist_ok=True)``, with this mode and group on each directory it creates
        (directories that exist already are left as they are)."""
        path = os.path.abspath(path)
        missing = []
        while not os.path.isdir(path):
            missing.append(path)
            parent = os.path.dirname(path)
            if parent == path:
                break
            path = parent
        for d in reversed(missing):
            with contextlib.suppress(FileExistsError):  # made by a concurrent writer: its perms are ours too
                os.mkdir(d)
                self.set_dir(d)


DEFAULT_PERMS = Perms()


def parse_mode(text: str) -> int:
    """An octal file mode such as ``0640``: read and write for the owner (the cache rewrites its
    files), no execute bits (directories get them from the read bits), nothing above 0o777."""
    try:
        mode = int(str(text).strip(), 8)
    except ValueError:
        raise ValueError(f"not an octal file mode: {text!r} (examples: 0644, 0640)") from None
    if mode & ~0o777 or mode & 0o111 or mode & 0o600 != 0o600:
        raise ValueError(
            f"file mode {text!r} must be within 0666, give the owner read and write (0600) and no "
            "execute bits (directories get search permission wherever the mode grants read)"
        )
    return mode


def parse_group(text: str) -> int:
    """A group name or numeric gid -> gid."""
    text = str(text).strip()
    try:
        return grp.getgrnam(text).gr_gid
    except KeyError:
        pass
    if text.isdigit():
        return int(text)
    raise ValueError(f"no such group: {text!r}")


__all__ = ["DEFAULT_PERMS", "Perms", "parse_group", "parse_mode"]
