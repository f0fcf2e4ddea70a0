"""Walking a directory source: which files count, in what order, and their sample keys.

Every way of packing a tree reads it through :func:`walk_files`: basename grouping (WebDataset
style, the default), one file = one sample (``--per-file``) and ImageFolder (``--label-from-dir``:
one file = one sample labelled by its class directory). Which files count:
- hidden entries (a name starting with '.') are ignored, files and directories alike;
- a symbolic link to a file is followed (the sample holds the target's bytes under the link's
  own path); a link to a directory is not descended, so there are no cycles and no file is
  packed twice; a link with no target is bad input, like an unreadable directory or anything
  that is not a regular file (a FIFO would block the reader forever, a device never ends).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator

from ..format.errors import BadSampleError
from ..format.keys import keys_for_paths

OnBad = Callable[[BadSampleError], None]
FLAGS_ADVICE = "pack with --per-file to make each file one sample, or --label-from-dir for class folders"
PER_FILE_HINT = f" ({FLAGS_ADVICE})"


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


def per_file_samples(root: str, on_bad: OnBad, under: str = "") -> list[tuple[str, str, str, int]]:
    """(key, relative path, path, size) of every file under ``root``, ordered by relative path,
    the paths under ``under`` where given (``root``'s own path below the packed trees' parent).

    Keys come from :func:`shardtool.format.keys.keys_for_paths`: unique and valid whatever the
    names, and the same for the same tree.
    """
    listed = walk_files(root, on_bad)
    if under:
        listed = ((f"{under}/{rel}", path, size) for rel, path, size in listed)
    return keyed_files(listed, on_bad)


def keyed_files(listed, on_bad: OnBad) -> list[tuple[str, str, str, int]]:
    """(key, relative path, path, size) of the listed ``(relative path, path, size)`` files, in
    relative-path order; a name that is not UTF-8 cannot be a sample's path and is bad input."""
    files = []
    for rel, path, size in listed:
        try:
            rel.encode("utf-8")
        except UnicodeEncodeError:
            on_bad(BadSampleError("file name is not valid UTF-8, so it cannot be a sample's path", source=path))
            continue
        files.append((rel, path, size))
    files.sort()
    keys = keys_for_paths([rel for rel, _, _ in files])
    return [(key, rel, path, size) for key, (rel, path, size) in zip(keys, files)]


LABEL_FIELD = "cls"  # WebDataset's name for an integer class label (member KEY.cls, decimal text)
IMAGE_FOLDER_SHAPE = "ROOT/CLASS/.../FILE.EXT, as torchvision's ImageFolder reads it"


def find_classes(root: str) -> list[str]:
    """The class names of an ImageFolder tree, in label order: its directories' names, sorted,
    as ``torchvision.datasets.folder.find_classes`` lists them (``os.scandir`` entries that are
    directories, links to directories included), so label ``i`` means what it means there.
    Hidden directories are not classes: hidden entries are ignored in every directory source.
    Raises BadSampleError naming ``root`` when it has no class directory."""
    try:
        with os.scandir(root) as entries:
            classes = sorted(e.name for e in entries if not e.name.startswith(".") and e.is_dir())
    except OSError as e:
        raise BadSampleError(f"cannot list directory ({e.strerror or e})", source=root) from None
    if not classes:
        raise BadSampleError(
            f"no class directories: --label-from-dir reads {IMAGE_FOLDER_SHAPE} and every "
            "file's label is the CLASS directory it is under",
            source=root,
        )
    return classes


def field_of_file(name: str) -> str:
    """The field a file's bytes are stored under: its last extension, lower-cased
    (``edit-copy.symbolic.png`` → ``png``, ``IMG_1.JPG`` → ``jpg``); '' when it has none."""
    stem, dot, ext = name.rpartition(".")
    return ext.lower() if dot and stem else ""


def image_folder_samples(root: str, on_bad: OnBad) -> tuple[list[str], list[tuple[str, str, int, str, int]]]:
    """(classes, samples) of an ImageFolder tree: every file under ``root/CLASS/`` is one sample
    ``(key, field, label, path, size)``, ordered by relative path, with the per-file keys of
    :func:`per_file_samples` (the path, class directory included, made a valid key).

    Every sample has the same fields (its file's extension and ``cls``), so a file whose
    extension is not the tree's most common one is bad input, as is a file directly in ``root``
    (it has no class) or one without an extension."""
    classes = find_classes(root)
    for name in _root_files(root):
        on_bad(
            BadSampleError(
                f"file is directly in the root, not in a class directory ({IMAGE_FOLDER_SHAPE})",
                source=os.path.join(root, name),
            )
        )
    # Each class directory is walked from itself, so a class that is a link to a directory is
    # read (torchvision follows it too); links below a class are not descended, as everywhere.
    listed = (
        (f"{c}/{rel}", path, size) for c in classes for rel, path, size in walk_files(os.path.join(root, c), on_bad)
    )
    label = {name: i for i, name in enumerate(classes)}
    files = []
    for key, rel, path, size in keyed_files(listed, on_bad):
        field = field_of_file(rel.rpartition("/")[2])
        if not field:
            on_bad(
                BadSampleError(
                    "file has no extension, so no field name (--label-from-dir stores a file's bytes "
                    "under its last extension, e.g. png)",
                    source=path,
                )
            )
        elif field == LABEL_FIELD:
            on_bad(BadSampleError(f"file extension {field!r} is the label field's name", source=path))
        else:
            files.append((key, field, label[rel.partition("/")[0]], path, size))
    return classes, _one_field(files, on_bad)


def _one_field(files: list[tuple[str, str, int, str, int]], on_bad: OnBad) -> list[tuple[str, str, int, str, int]]:
    """The samples whose field is the most common one (ties: the first in name order); each other
    file is bad input, named with what the tree holds, since a dataset has one set of fields."""
    counts: dict[str, int] = {}
    for f in files:
        counts[f[1]] = counts.get(f[1], 0) + 1
    if len(counts) <= 1:
        return files
    main = max(sorted(counts), key=lambda ext: counts[ext])
    held = ", ".join(f"{n} {ext}" for ext, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    keep = []
    for f in files:
        if f[1] == main:
            keep.append(f)
        else:
            on_bad(
                BadSampleError(
                    f"extension {f[1]!r} differs from the tree's {main!r} (it holds {held} files) and "
                    "every sample of a dataset has the same fields: convert these files, or pack with "
                    "--per-file",
                    source=f[3],
                )
            )
    return keep


def _root_files(root: str) -> list[str]:
    """Names of the entries directly in ``root`` that are not directories (hidden ones ignored)."""
    with os.scandir(root) as entries:
        return sorted(e.name for e in entries if not e.name.startswith(".") and not e.is_dir())
