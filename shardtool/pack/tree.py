"""Walking a directory source: which files count, in what order, and their sample keys.

Both ways of packing a tree read it through :func:`walk_files`: basename grouping (WebDataset
style, the default) and one file = one sample (``--per-file``). Which files count:
- hidden entries (a name starting with '.') are ignored, files and directories alike;
- a symbolic link to a file is followed (the sample holds the target's bytes under the link's
  own path); a link to a directory is not descended, so there are no cycles and no file is
  packed twice; a link with no target is bad input, like an unreadable directory or anything
  that is not a regular file (a FIFO would block the reader forever, a device never ends).
"""
from __future__ import annotations

import os
import stat
from typing import Callable, Iterator

from ..format.errors import BadSampleError
from ..format.keys import keys_for_paths

OnBad = Callable[[BadSampleError], None]
PER_FILE_HINT = " (pack with --per-file to make each file one sample)"


def walk_files(root: str, on_bad: OnBad) -> Iterator[tuple[str, str, int]]:
    """(relative path with '/' separators, path, size) of every file that counts, in a fixed
    order (each directory's files by name, then its subdirectories by name)."""

    def unlisted(e: OSError) -> None:
        on_bad(BadSampleError(f"cannot list directory ({e.strerror or e})", source=e.filename or root))

    for dirpath, dirnames, filenames in os.walk(root, onerror=unlisted):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        reldir = os.path.relpath(dirpath, root)
        prefix = "" if reldir == "." else reldir.replace(os.sep, "/") + "/"
        for name in sorted(filenames):
            if name.startswith("."):
                continue
            path = os.path.join(dirpath, name)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                what = "symbolic link with no target" if os.path.islink(path) else "file vanished while listing"
                on_bad(BadSampleError(what, source=path))
                continue
            except OSError as e:
                on_bad(BadSampleError(f"cannot stat ({e.strerror or e})", source=path))
                continue
            if not stat.S_ISREG(st.st_mode):
                on_bad(BadSampleError("not a regular file (a FIFO, socket or device)", source=path))
                continue
            yield prefix + name, path, st.st_size


def per_file_samples(root: str, on_bad: OnBad) -> list[tuple[str, str, str, int]]:
    """(key, relative path, path, size) of every file under ``root``, ordered by relative path.

    Keys come from :func:`shardtool.format.keys.keys_for_paths`: unique and valid whatever the
    names, and the same for the same tree.
    """
    files = []
    for rel, path, size in walk_files(root, on_bad):
        try:
            rel.encode("utf-8")
        except UnicodeEncodeError:
            on_bad(BadSampleError("file name is not valid UTF-8, so it cannot be a sample's path", source=path))
            continue
        files.append((rel, path, size))
    files.sort()
    keys = keys_for_paths([rel for rel, _, _ in files])
    return [(key, rel, path, size) for key, (rel, path, size) in zip(keys, files)]
