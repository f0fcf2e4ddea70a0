"""Other loaders' datasets as pack sources, each known by its own index file:

- ``PREFIX.idx`` + ``PREFIX.bin``: Megatron/NeMo indexed dataset (:mod:`.megatron`);
- a directory whose ``index.json`` lists ``"shards"`` of ``"format": "mds"``: MosaicML
  Streaming (:mod:`.mds`);
- a directory whose ``index.json`` has ``"chunks"`` and ``"config"``: LitData ``optimize()``
  output (:mod:`.litdata`).

All three are read from their documented on-disk formats, without the peers' libraries, as
Arrow record batches (one column per field, dtypes kept), so the columnar packer takes them as
it takes Parquet, and the same rows give the same dataset byte for byte.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

from ..format.errors import BadSampleError
from .workunit import Unit


def foreign_units(src: str) -> list[Unit] | None:
    """The units of ``src`` if it is another loader's dataset, else None."""
    from .megatron import megatron_units, prefix_of

    if prefix_of(src) is not None:
        return megatron_units(src)
    index = os.path.join(src, "index.json")
    if not os.path.isdir(src) or not os.path.isfile(index):
        return None
    try:
        with open(index, "rb") as f:
            body = json.loads(f.read())
    except (OSError, ValueError) as e:
        raise BadSampleError(f"unreadable index.json ({e})", source=index) from None
    if not isinstance(body, dict):
        return None
    shards = body.get("shards")
    if isinstance(shards, list) and shards and isinstance(shards[0], dict) and "column_encodings" in shards[0]:
        from .mds import mds_units

        return mds_units(src, body)
    if (
        isinstance(body.get("chunks"), list)
        and isinstance(body.get("config"), dict)
        and "data_format" in body["config"]
    ):
        from .litdata import litdata_units

        return litdata_units(src, body)
    return None  # some other index.json (a shardtool dataset, a file tree's own): not a source of ours here


def foreign_batches(unit: Unit) -> Iterator:
    if unit.kind == "megatron":
        from .megatron import megatron_batches

        return megatron_batches(unit)
    if unit.kind == "mds":
        from .mds import mds_batches

        return mds_batches(unit)
    from .litdata import litdata_batches

    return litdata_batches(unit)


def where(unit: Unit, pos: int) -> str:
    if unit.kind == "megatron":
        return f"document {unit.start + pos}"
    return f"{os.path.basename(unit.members[0]) if unit.members else 'shard'} sample {pos}"


def default_length(units: list[Unit]) -> str | None:
    """The length a source defines itself: a Megatron dataset's token count."""
    return "tokens" if units and all(u.kind == "megatron" for u in units) else None
