"""Real documents made on this machine, with real shapes: the Python standard library's source
files and the text files of /usr/share/doc (long, heavy-tailed; a few files of megabytes).
Used by the benchmarks and the test suite alike, read as byte ids (a length is a file's size)."""

from __future__ import annotations

import os
import sysconfig

import numpy as np

STDLIB = sysconfig.get_paths()["stdlib"]


def stdlib_files(limit: int | None = None, *, subdirs: tuple[str, ...] = ()) -> list[str]:
    """Sorted paths of the stdlib's non-empty .py files (not site-packages), or of ``subdirs`` of it."""
    roots = [os.path.join(STDLIB, d) for d in subdirs] or [STDLIB]
    paths = []
    for root in roots:
        for d, dirs, files in os.walk(root):
            dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "__pycache__"))
            paths += [os.path.join(d, f) for f in sorted(files) if f.endswith(".py")]
    paths = [p for p in sorted(paths) if os.path.getsize(p) > 0]
    return paths[:limit] if limit is not None else paths


def stdlib_lengths() -> np.ndarray:
    """Lengths of the stdlib files as byte ids: ~1,800 documents, median ~7k, a few over 100k."""
    return np.array([os.path.getsize(p) for p in stdlib_files()], dtype=np.int64)


def doc_files() -> list[str]:
    """The regular files under /usr/share/doc, in a fixed order: thousands of small files and a few
    of megabytes. Empty when the machine has none."""
    out = []
    for d, dirs, files in os.walk("/usr/share/doc"):
        dirs.sort()
        for f in sorted(files):
            p = os.path.join(d, f)
            if os.path.isfile(p) and not os.path.islink(p):
                out.append(p)
    return out


def doc_lengths() -> np.ndarray:
    """Lengths (bytes) of `doc_files`."""
    return np.array([os.path.getsize(p) for p in doc_files()], dtype=np.int64)


def long_document_lengths() -> np.ndarray:
    """Every stdlib file and /usr/share/doc text, untruncated, as byte-id lengths (empty ones out)."""
    both = np.concatenate([stdlib_lengths(), doc_lengths()])
    return both[both > 0]


def stdlib_docstrings(limit: int) -> list[tuple[str, str]]:
    """(signature, docstring) of up to ``limit`` documented functions of the stdlib's top-level
    modules, in a fixed order: the user and assistant turns of real chat-shaped data."""
    import ast

    out: list[tuple[str, str]] = []
    for name in sorted(os.listdir(STDLIB)):
        if not name.endswith(".py"):
            continue
        try:
            with open(os.path.join(STDLIB, name), encoding="utf-8") as f:
                tree = ast.parse(f.read())
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            doc = ast.get_docstring(node) if isinstance(node, ast.FunctionDef) else None
            if doc:
                out.append((f"def {node.name}({ast.unparse(node.args)}):", doc))
                if len(out) == limit:
                    return out
    return out
