"""Megatron-Energon: the corpus' WebDataset tar shards, ``energon prepare``-d, read by its loader.

Set up as its docs' "data preparation" + "basic usage": the tar shards (same bytes as
webdataset reads) are copied with their own directory, indexed with the CLI ``energon prepare
DIR --non-interactive --split-ratio 1,0,0 --sample-type CrudeWebdataset``, and read with
``get_train_dataset(DIR, worker_config=WorkerConfig(rank, world_size, num_workers),
batch_size=B, shuffle_buffer_size=1000, max_samples_per_sequence=100, repeat=False,
task_encoder=…)`` + ``get_savable_loader``. The task encoder's cooker turns a crude sample into
a ``Sample`` with the decoded payload; its ``batch`` builds the same batch as the other sides.
Resume: the savable loader's ``save_state_rank()`` / ``restore_state_rank()``.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

import numpy as np

NAME = "Energon"
_ENCODER = None


def version() -> str:
    from importlib.metadata import version as v

    import megatron.energon  # noqa: F401

    return "megatron-energon " + v("megatron-energon")


def prepare(src: str, out: str, kind: str, workers: int = 1) -> None:
    """The tar shards copied to ``out`` (a ShardWriter's output as-is), then the CLI's prepare."""
    from . import tar_paths

    os.makedirs(out, exist_ok=True)
    for p in tar_paths(src):
        shutil.copyfile(p, os.path.join(out, os.path.basename(p)))
    cli = os.path.join(os.path.dirname(sys.executable), "energon")
    subprocess.run(
        [
            cli,
            "prepare",
            out,
            "--non-interactive",
            "--force-overwrite",
            "--split-ratio",
            "1,0,0",
            "--sample-type",
            "CrudeWebdataset",
            "--num-workers",
            str(max(1, workers)),
            "--no-progress",
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )


def _types():
    """The sample type and task encoder, made on first use (energon imported only then)."""
    global _ENCODER
    if _ENCODER is not None:
        return _ENCODER
    from megatron.energon import (
        Cooker,
        DefaultTaskEncoder,
        Sample,
        basic_sample_keys,
        stateless,
    )

    @dataclass
    class Payload(Sample):
        payload: object = None

    @stateless
    def cook(raw: dict) -> Payload:
        data = raw.get("tokens.npy", raw.get("jpg"))
        if "tokens.npy" in raw and isinstance(data, (bytes, bytearray)):
            data = np.load(io.BytesIO(data))
        return Payload(**basic_sample_keys(raw), payload=data)

    class Encoder(DefaultTaskEncoder):
        cookers = [Cooker(cook)]  # noqa: RUF012 - energon reads it as a class attribute
        decoder = None  # raw bytes, as webdataset delivers them here (the cooker loads the npy)

        def __init__(self, kind: str):
            super().__init__()
            self.kind = kind

        def batch(self, samples):
            from . import pad

            keys = [s.__key__.rsplit("/", 1)[-1] for s in samples]
            if self.kind == "tokens":
                return pad(keys, [s.payload for s in samples])
            return {"__key__": keys, "jpg": [bytes(s.payload) for s in samples]}

        def encode_batch(self, batch):
            return batch

    _ENCODER = Encoder
    return Encoder


def loader(
    out: str,
    kind: str,
    workers: int,
    batch: int,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    state=None,
    repeat: bool = False,
    task_encoder=None,
):
    """Energon's savable loader over ``out`` as its docs set it up; ``task_encoder`` replaces the
    default one for ``kind`` (benchmarks.peer_images decodes images in its own)."""
    from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset

    wc = WorkerConfig(rank=rank, world_size=world_size, num_workers=workers, seed_offset=seed)
    ds = get_train_dataset(
        out,
        worker_config=wc,
        batch_size=batch,
        shuffle_buffer_size=1000,
        max_samples_per_sequence=100,
        repeat=repeat,
        task_encoder=task_encoder if task_encoder is not None else _types()(kind),
    )
    ld = get_savable_loader(ds)
    if state is not None:
        ld.restore_state_rank(state)
    return ld


def state_dict(ld, batches_seen: int):
    return ld.save_state_rank()
