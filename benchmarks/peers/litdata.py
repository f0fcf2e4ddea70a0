"""LitData: ``litdata.optimize`` chunks read by ``StreamingDataset`` + ``StreamingDataLoader``.

Set up as its README's "optimize then stream" path: ``optimize(fn, inputs, output_dir,
chunk_bytes="64MB", num_workers=W)`` where ``fn`` yields one dict per sample of an input tar
shard (``{"key": str, "tokens": np.ndarray}`` or ``{"key": str, "jpg": bytes}``), then
``StreamingDataset(output_dir, shuffle=True, seed=…)`` in ``StreamingDataLoader(batch_size=B,
num_workers=W, collate_fn=…)``. Ranks: it reads the torch.distributed world, else the env vars
its ``_DistributedEnv`` reads (``WORLD_SIZE``/``GLOBAL_RANK`` with ``NODE_RANK``). Resume: the
loader's ``state_dict()`` / ``load_state_dict()``.
"""

from __future__ import annotations

import os

NAME = "LitData"


def version() -> str:
    import litdata

    return "litdata " + litdata.__version__


class _Shard:
    """optimize's fn: every sample of one tar shard, as a dict (a generator: several items per input)."""

    def __init__(self, kind: str):
        self.kind = kind

    def __call__(self, path: str):
        from . import tar_samples

        field = "tokens" if self.kind == "tokens" else "jpg"
        for key, payload in tar_samples(os.path.dirname(path), self.kind, [path]):
            yield {"key": key, field: payload}


def prepare(src: str, out: str, kind: str, workers: int = 1) -> None:
    import litdata

    from . import tar_paths

    litdata.optimize(
        fn=_Shard(kind),
        inputs=tar_paths(src),
        output_dir=out,
        chunk_bytes="64MB",
        num_workers=max(1, workers),
        mode="overwrite",
        verbose=False,
    )


class _Collate:
    def __init__(self, kind: str):
        self.kind = kind

    def __call__(self, rows):
        from . import pad

        if self.kind == "tokens":
            return pad([r["key"] for r in rows], [r["tokens"] for r in rows])
        return {"__key__": [r["key"] for r in rows], "jpg": [r["jpg"] for r in rows]}


def loader(
    out: str,
    kind: str,
    workers: int,
    batch: int,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    state: dict | None = None,
):
    import litdata

    os.environ.update(
        {
            "WORLD_SIZE": str(world_size),
            "GLOBAL_RANK": str(rank),
            "RANK": str(rank),
            "LOCAL_RANK": "0",
            "NODE_RANK": "0",
        }
    )
    ds = litdata.StreamingDataset(out, shuffle=True, seed=seed)  # drop_last: its default (True on several ranks)
    ld = litdata.StreamingDataLoader(ds, batch_size=batch, num_workers=workers, collate_fn=_Collate(kind))
    if state is not None:
        ld.load_state_dict(state)
    return ld


def state_dict(ld, batches_seen: int) -> dict:
    return ld.state_dict()
