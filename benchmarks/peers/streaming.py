"""MosaicML Streaming: ``MDSWriter`` shards read by ``StreamingDataset`` + ``StreamingDataLoader``.

Set up as its docs' quick start: ``MDSWriter(columns={"key": "str", "tokens": "ndarray:int32"})``
(``"jpg": "bytes"`` for the image-like corpus), then ``StreamingDataset(local=…, shuffle=True,
batch_size=B)`` (default shuffle algorithm ``py1e``, ``num_canonical_nodes`` its default) in a
``StreamingDataLoader`` with the same collate as the other sides. Resume: the loader's
``state_dict()`` / ``load_state_dict()`` (its mid-epoch resumption).

Import shim: ``import streaming`` imports ``streaming.vision`` (its CIFAR/ImageNet dataset
classes), which imports torchvision; the only torchvision wheels on this index are CUDA builds
that a CPU torch cannot load ("operator torchvision::nms does not exist"). The MDS path used here
never touches torchvision, so where torchvision does not import, ``streaming.vision`` is replaced
by an empty module before ``streaming`` is imported (benchmarks/setup_peers.sh uninstalls the
unloadable torchvision wheel). Nothing else of Streaming is changed.
"""

from __future__ import annotations

import os
import sys
import types

NAME = "Streaming"


def load():
    if "streaming" not in sys.modules:
        try:
            import torchvision  # noqa: F401
        except Exception:  # noqa: BLE001 - absent (ImportError), or a CUDA wheel next to a CPU torch (RuntimeError)
            sys.modules["streaming.vision"] = types.ModuleType("streaming.vision")
    import streaming

    return streaming


def version() -> str:
    return "mosaicml-streaming " + load().__version__


def prepare(src: str, out: str, kind: str, workers: int = 0) -> int:
    """MDS shards of the corpus in ``out`` (MDSWriter writes in one process; ``workers`` unused)."""
    from . import tar_samples

    streaming = load()
    columns = {"key": "str", "tokens": "ndarray:int32"} if kind == "tokens" else {"key": "str", "jpg": "bytes"}
    field = "tokens" if kind == "tokens" else "jpg"
    n = 0
    with streaming.MDSWriter(out=out, columns=columns, size_limit="64mb", exist_ok=True) as w:
        for key, payload in tar_samples(src, kind):
            w.write({"key": key, field: payload})
            n += 1
    return n


def _collate(kind: str):
    from . import pad

    if kind == "tokens":
        return lambda rows: pad([r["key"] for r in rows], [r["tokens"] for r in rows])
    return lambda rows: {"__key__": [r["key"] for r in rows], "jpg": [r["jpg"] for r in rows]}


class _Collate:
    """Picklable collate (workers may spawn)."""

    def __init__(self, kind: str):
        self.kind = kind

    def __call__(self, rows):
        return _collate(self.kind)(rows)


def loader(
    out: str,
    kind: str,
    workers: int,
    batch: int,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    state: dict | None = None,
    canonical_nodes: int | None = None,
):
    """StreamingDataset over the MDS shards; ranks as its docs set them: RANK/WORLD_SIZE/LOCAL_* env
    (one node here: LOCAL_WORLD_SIZE = WORLD_SIZE; with several ranks it joins torch.distributed
    through MASTER_ADDR/MASTER_PORT, which the caller sets, all ranks running at once)."""
    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size)}
    )
    streaming = load()
    if world_size == 1:  # several ranks: the caller cleans once, before they start (they share it)
        clean()
    # num_canonical_nodes: its default, except where ranks change (its docs: a value that every
    # world size divides, kept across the resume).
    ds = streaming.StreamingDataset(
        local=out, shuffle=True, shuffle_seed=seed, batch_size=batch, num_canonical_nodes=canonical_nodes
    )
    ld = streaming.StreamingDataLoader(
        ds, batch_size=batch, num_workers=workers, collate_fn=_Collate(kind), persistent_workers=False
    )
    if state is not None:
        ld.load_state_dict(state)
    return ld


def clean() -> None:
    """Its docs' advice before a run: remove shared memory a killed earlier run left behind."""
    load().base.util.clean_stale_shared_memory()


def state_dict(ld, batches_seen: int) -> dict:
    return ld.state_dict()
