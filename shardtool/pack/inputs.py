"""Reading the sources before a pack: their units, counts, classes and the fields of the first sample.

Split from `api` so that `pack()` reads as the sequence of its decisions; these helpers are the
part that touches the input (each opens or counts sources) and raises on what it finds there.
"""

from __future__ import annotations

import dataclasses

from ..format.errors import BadSampleError, ShardtoolError
from ..format.fields import FieldSpec
from .readers import Bad, count_unit, read_unit
from .schema import infer_fields
from .skips import skip_entry
from .sources import memory_units
from .units import Unit, discover


def first_sample_fields(units: list[Unit], *, max_sample_bytes, skip_bad, key_field) -> list[FieldSpec]:
    def on_bad(err):
        if not skip_bad:
            raise err

    for unit in units:
        try:
            records = (
                read_unit(unit, max_sample_bytes=max_sample_bytes, on_bad=on_bad)
                if not unit.stream
                else _peek_stream(unit)
            )
            for rec in records:
                if rec.__class__ is Bad:
                    on_bad(rec.error)
                    continue
                _, _, obj, where = rec
                return infer_fields(unit.kind, obj, source=unit.path, where=where, key_field=key_field)
        except BadSampleError as e:
            on_bad(e)
    if not units:
        raise ShardtoolError("no sources to pack")
    paths = list(dict.fromkeys(str(u.path) for u in units))
    named = ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")
    raise ShardtoolError(f"no samples found in the sources (no rows or lines in {named})")


def _peek_stream(unit: Unit):
    """The first records of a stream; the stream keeps what is read, to replay it when packing."""
    from .readers import batch_rows

    if unit.obj.items == "dicts":
        for i, obj in enumerate(unit.obj.peek()):
            yield i, None, obj, f"row {i}"
        return
    for batch in unit.obj.peek():
        yield from batch_rows(unit, batch, 0)


def counted_units(units: list[Unit], *, skip_bad: bool, skipped: list[str]) -> list[Unit]:
    """Running-position keys need every structured unit's count, in every task alike."""
    counted = []
    for u in units:
        if u.structured and u.count < 0 and not u.stream:
            try:
                u = dataclasses.replace(u, count=count_unit(u))
            except BadSampleError as e:
                if not skip_bad:
                    raise
                skipped.append(skip_entry(e))
                continue
        counted.append(u)
    return counted


def source_units(
    sources: list, *, skip_bad: bool, skipped: list[str], per_file: bool, label_from_dir: bool = False
) -> list[Unit]:
    """Units of paths and in-memory sources, in the order given."""
    units: list[Unit] = []
    paths: list[str] = []
    for i, src in enumerate(sources):
        if isinstance(src, str):
            paths.append(src)
            continue
        if label_from_dir:
            raise ShardtoolError(
                f"label_from_dir reads directories (ROOT/CLASS/FILE); source #{i} is a {type(src).__name__}"
            )
        units.extend(discover(paths, skip_bad=skip_bad, skipped=skipped, per_file=per_file))
        paths = []
        units.extend(memory_units(src, i, len(sources)))
    units.extend(discover(paths, skip_bad=skip_bad, skipped=skipped, per_file=per_file, label_from_dir=label_from_dir))
    return units


def class_names(units: list[Unit]) -> dict:
    """The manifest's ``extra`` of an ImageFolder pack: its class names in label order. Several
    trees are one dataset only when their classes are the same, so that a label means one class."""
    trees = {u.path: u.obj for u in units if u.kind == "images"}
    if not trees:
        return {}
    first_path, classes = next(iter(trees.items()))
    for path, other in trees.items():
        if other != classes:
            raise ShardtoolError(
                f"--label-from-dir: {path} has classes {list(other)[:8]}, {first_path} has "
                f"{list(classes)[:8]}; labels would mean different classes (pack them separately)"
            )
    return {"classes": list(classes)}
