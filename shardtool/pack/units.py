"""Sources → deterministic units of work, and the pure split of units over tasks and workers.

A *unit* is the smallest piece of input one worker packs: a Parquet row group, a group of
Arrow record batches, a ~32 MiB newline-aligned chunk of a plain JSONL file, a whole
compressed JSONL or tar file, or a run of file-tree samples (``tree``: files grouped by
basename; ``files``: one file = one sample, with ``--per-file``; ``images``: one file = one
sample labelled by its class directory, with ``--label-from-dir``). Units are listed in input order
by every task identically, so slicing them is a pure function of (units, T, I, N), and sample
positions (the default keys) come from unit counts, not from who packs what.
"""

from __future__ import annotations

import glob
import os
from typing import Any

from ..format.errors import BadSampleError, ShardtoolError
from ..format.keys import key_problem
from .options import strip_file_scheme
from .skips import skip_entry
from .tree import PER_FILE_HINT, OnBad, image_folder_samples, per_file_samples, walk_files
from .workunit import Unit

JSONL_CHUNK = 8 << 20  # small enough to balance workers when samples are costly (tokenizing)
TREE_CHUNK = 256
ARROW_UNIT_ROWS = 65536


def kind_of(path: str) -> str | None:
    p = path.lower()
    if p.endswith((".jsonl", ".jsonl.gz", ".jsonl.zst", ".ndjson", ".ndjson.gz", ".ndjson.zst")):
        return "jsonl"
    if p.endswith((".parquet", ".pq")):
        return "parquet"
    if p.endswith((".arrow", ".feather", ".ipc")):
        return "arrow"
    if p.endswith((".tar", ".tar.gz", ".tgz", ".tar.zst")):
        return "tar"
    return None


def expand_sources(srcs: list[str]) -> list[str]:
    """Each SRC as given; glob patterns expand (sorted). Missing paths are kept (reported later)."""
    out: list[str] = []
    for s in srcs:
        s = strip_file_scheme(s)
        if any(c in s for c in "*?[") and not os.path.exists(s):
            matches = sorted(glob.glob(s))
            out.extend(matches if matches else [s])
        else:
            out.append(s)
    return out


def discover(
    srcs: list[str], *, skip_bad: bool, skipped: list[str], per_file: bool = False, label_from_dir: bool = False
) -> list[Unit]:
    """Units of every source, in order. With ``skip_bad`` a bad source, or a bad file of a
    directory source (only that file), is listed in ``skipped``; otherwise it raises."""

    def on_bad(err: BadSampleError) -> None:
        if not skip_bad:
            raise err
        skipped.append(skip_entry(err))

    units: list[Unit] = []
    expanded = expand_sources(srcs)
    under = per_file_names(expanded) if per_file else {}
    for src in expanded:
        try:
            if src in under:
                units.extend(file_units(src, on_bad, under=under[src]))
                continue
            units.extend(units_of(src, per_file=per_file, label_from_dir=label_from_dir, on_bad=on_bad))
        except BadSampleError as e:
            on_bad(e)
    return units


def per_file_names(srcs: list[str]) -> dict[str, str]:
    """Where several directories are packed ``--per-file``: each one's path under their common
    parent, which names its files (``email/__init__.py``, ``json/__init__.py``), as ``tar -C
    PARENT email json`` would. Named from each root alone, files the trees share (``__init__.py``,
    ``README``) had one key and the pack failed. One directory: its files' paths are as in it."""
    dirs = [s for s in srcs if os.path.isdir(s)]
    if len(dirs) < 2:
        return {}
    parent = os.path.commonpath([os.path.abspath(d) for d in dirs])
    out = {}
    for d in dirs:
        rel = os.path.relpath(os.path.abspath(d), parent)
        out[d] = "" if rel == "." else rel.replace(os.sep, "/")
    return out


def _raise(err: BadSampleError) -> None:
    raise err


def units_of(src: str, *, per_file: bool = False, label_from_dir: bool = False, on_bad: OnBad = _raise) -> list[Unit]:
    from .foreign import foreign_units  # another loader's dataset, known by its own index file

    found = None if per_file or label_from_dir else foreign_units(src)
    if found is not None:
        return found
    if os.path.isdir(src):
        if label_from_dir:
            return image_units(src, on_bad)
        return file_units(src, on_bad) if per_file else tree_units(src, on_bad)
    if label_from_dir and os.path.exists(src):
        raise BadSampleError(
            "--label-from-dir reads directories (ROOT/CLASS/FILE), this is a file", source=src, lost=None
        )
    if not os.path.exists(src):
        raise BadSampleError("source does not exist", source=src, lost=None)
    if not os.access(src, os.R_OK):
        raise BadSampleError("source is not readable (permission denied)", source=src, lost=None)
    kind = kind_of(src)
    if kind is None:
        raise BadSampleError(
            "unknown source type (expected a directory, .jsonl[.gz|.zst], .parquet, .arrow or .tar)",
            source=src,
            lost=None,
        )
    try:
        if kind == "jsonl":
            return jsonl_units(src)
        if kind == "parquet":
            return parquet_units(src)
        if kind == "arrow":
            return arrow_units(src)
    except OSError as e:
        raise BadSampleError(f"cannot read source ({e})", source=src, lost=None) from None
    return [Unit("tar", src, weight=os.path.getsize(src))]


def jsonl_units(path: str) -> list[Unit]:
    size = os.path.getsize(path)
    if not path.lower().endswith((".jsonl", ".ndjson")):
        return [Unit("jsonl", path, 0, -1, -1, 0, max(size, 1) * 4)]
    # One pass over the file: newline counts, and a chunk boundary after the first newline
    # past every JSONL_CHUNK bytes.
    units = []
    start, lines_before, lines_in_chunk, pos = 0, 0, 0, 0
    last = b"\n"
    with open(path, "rb", buffering=0) as f:
        while True:
            block = f.read(8 << 20)
            if not block:
                break
            last = block[-1:]
            base = 0
            while True:
                cut = start + JSONL_CHUNK - (pos + base)
                if cut >= len(block) - base:
                    lines_in_chunk += block.count(b"\n", base)
                    break
                nl = block.find(b"\n", base + max(cut, 0))
                if nl < 0:
                    lines_in_chunk += block.count(b"\n", base)
                    break
                lines_in_chunk += block.count(b"\n", base, nl + 1)
                units.append(
                    Unit("jsonl", path, start, pos + nl + 1, lines_in_chunk, lines_before, pos + nl + 1 - start)
                )
                lines_before += lines_in_chunk
                start, lines_in_chunk, base = pos + nl + 1, 0, nl + 1
            pos += len(block)
    if pos > start:
        lines_in_chunk += 0 if last == b"\n" else 1
        units.append(Unit("jsonl", path, start, pos, lines_in_chunk, lines_before, pos - start))
    return units


def parquet_units(path: str) -> list[Unit]:
    import pyarrow.parquet as pq

    try:
        md = pq.ParquetFile(path).metadata
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError variants
        raise BadSampleError(f"not a readable Parquet file ({e})", source=path, lost=None) from None
    return [
        Unit("parquet", path, g, g + 1, md.row_group(g).num_rows, 0, max(md.row_group(g).total_byte_size, 1))
        for g in range(md.num_row_groups)
    ]


def arrow_units(path: str) -> list[Unit]:
    import pyarrow as pa

    try:
        with pa.memory_map(path) as src:
            reader = pa.ipc.open_file(src)
            rows = [reader.get_batch(i).num_rows for i in range(reader.num_record_batches)]
    except pa.ArrowInvalid:
        # An Arrow *stream* has no footer to seek by: one unit, counted when read.
        return [Unit("arrow", path, 0, -1, -1, 0, os.path.getsize(path))]
    except Exception as e:
        raise BadSampleError(f"not a readable Arrow IPC file ({e})", source=path, lost=None) from None
    units, start, acc = [], 0, 0
    for i, r in enumerate(rows):
        acc += r
        if acc >= ARROW_UNIT_ROWS or i == len(rows) - 1:
            units.append(Unit("arrow", path, start, i + 1, acc, 0, acc))
            start, acc = i + 1, 0
    return units


def tree_key(reldir: str, stem: str) -> str:
    return f"{reldir.replace(os.sep, '__').replace('/', '__')}__{stem}" if reldir else stem


def tree_units(root: str, on_bad: OnBad = _raise) -> list[Unit]:
    """Group files by (directory, basename up to the first '.'), WebDataset style."""
    groups: dict[str, list[tuple[str, str]]] = {}
    origin: dict[str, str] = {}
    sizes: dict[str, int] = {}
    for rel, path, size in walk_files(root, on_bad):
        reldir, _, name = rel.rpartition("/")
        stem, dot, ext = name.partition(".")
        if not dot or not ext:
            on_bad(BadSampleError("file has no '<key>.<field>' name" + PER_FILE_HINT, source=path))
            continue
        key = tree_key(reldir, stem)
        problem = key_problem(key)
        if problem:
            on_bad(BadSampleError(problem + PER_FILE_HINT, source=path))
            continue
        rel_group = os.path.join(reldir, stem)
        if key in origin and origin[key] != rel_group:
            on_bad(
                BadSampleError(f"duplicate key {key!r} (also made from {origin[key]!r})" + PER_FILE_HINT, source=path)
            )
            continue
        origin[key] = rel_group
        groups.setdefault(key, []).append((ext, path))
        sizes[key] = sizes.get(key, 0) + size
    samples = sorted(groups.items(), key=lambda kv: origin[kv[0]])
    chunks = [
        tuple((k, tuple(sorted(v))) for k, v in samples[i : i + TREE_CHUNK]) for i in range(0, len(samples), TREE_CHUNK)
    ]
    return _tree_chunk_units("tree", root, chunks, [sum(sizes[k] for k, _ in c) for c in chunks])


def file_units(root: str, on_bad: OnBad = _raise, under: str = "") -> list[Unit]:
    """One file = one sample (``--per-file``): fields ``bin`` (its bytes) and ``path``, relative to
    ``root``, or with ``under`` to ``root``'s parent as `per_file_names` gives it."""
    samples = per_file_samples(root, on_bad, under)
    chunks = [samples[i : i + TREE_CHUNK] for i in range(0, len(samples), TREE_CHUNK)]
    return _tree_chunk_units(
        "files",
        root,
        [tuple((k, rel, p) for k, rel, p, _ in c) for c in chunks],
        [sum(size for *_, size in c) for c in chunks],
    )


def image_units(root: str, on_bad: OnBad = _raise) -> list[Unit]:
    """ImageFolder (``--label-from-dir``): one file = one sample, fields its extension and ``cls``."""
    classes, samples = image_folder_samples(root, on_bad)
    chunks = [samples[i : i + TREE_CHUNK] for i in range(0, len(samples), TREE_CHUNK)]
    return _tree_chunk_units(
        "images",
        root,
        [tuple((k, f, c, p) for k, f, c, p, _ in ch) for ch in chunks],
        [sum(size for *_, size in ch) for ch in chunks],
        obj=tuple(classes),
    )


def _tree_chunk_units(kind: str, root: str, chunks: list[tuple], weights: list[int], obj: Any = None) -> list[Unit]:
    units, start = [], 0
    for chunk, weight in zip(chunks, weights):
        units.append(Unit(kind, root, start, start + len(chunk), len(chunk), 0, max(weight, 1), chunk, obj))
        start += len(chunk)
    return units


# --------------------------------------------------------------------------- pure decisions
def split_contiguous(weights: list[int], parts: int) -> list[tuple[int, int]]:
    """Cut ``weights`` into ``parts`` contiguous ranges of about equal total weight.

    Deterministic and order-preserving, so shard order follows input order. Ranges may be empty
    when there are fewer units than parts.
    """
    if parts < 1:
        raise ValueError("parts must be ≥ 1")
    total = sum(weights)
    bounds = [0]
    acc = 0
    i = 0
    for p in range(1, parts):
        target = total * p / parts
        while i < len(weights) and acc + weights[i] / 2 <= target:
            acc += weights[i]
            i += 1
        bounds.append(i)
    bounds.append(len(weights))
    return [(bounds[k], bounds[k + 1]) for k in range(parts)]


def positions(units: list[Unit]) -> list[int]:
    """First sample position of every unit: a prefix sum of counts (structured units only)."""
    out, acc = [], 0
    for u in units:
        out.append(acc)
        if u.structured:
            if u.count < 0:
                if not u.stream:
                    raise ShardtoolError(f"internal: unit of {u.path} was not counted")
                acc = -1 << 62  # unknown after a stream: its job counts positions as it reads
            acc += u.count
    out.append(acc)
    return out


def idle_note(units: list[Unit], mine: list[Unit], tasks: int, workers: int) -> str | None:
    """Where the sources split into fewer pieces of work than the array's tasks or this task's
    workers, what to do about it: a Parquet row group, a run of Arrow record batches, a JSONL
    chunk of 8 MiB or a file tree's 256 files is one worker's, and pyarrow writes a file of under a
    million rows as one row group, so ``--workers 8`` on it packed with one worker, silently."""
    if len(units) >= tasks and len(mine) >= workers:
        return None
    n, who = (len(units), f"{tasks} tasks") if len(units) < tasks else (len(mine), f"{workers} workers")
    parquet = any(u.kind == "parquet" for u in units)
    fix = " (write Parquet in smaller row groups, e.g. pyarrow's row_group_size=100_000)" if parquet else ""
    return f"the sources split into {n} piece(s) of work for {who}: the rest have nothing to pack{fix}"
