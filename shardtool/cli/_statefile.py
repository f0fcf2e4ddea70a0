"""A loader state as the commands read it: a JSON file (``json.dump(loader.state_dict())``), or a
trainer's torch checkpoint that holds it (``torch.save({"model": ..., "loader": loader.state_dict()})``,
as the README's recipe and examples/train_ddp.py save it), read with ``weights_only=True``: plain
containers and tensors, never arbitrary pickled objects."""

from __future__ import annotations

import json
from typing import Any

from ..format.errors import ShardtoolError

__all__ = ["StateFile", "read_state_file"]


class StateFile:
    """``doc``: the file's whole content; ``state``: the loader state in it; ``key``: where (None:
    the whole file); ``json``: whether the file is JSON (a torch checkpoint is only read)."""

    def __init__(self, doc: Any, state: Any, key: str | None, is_json: bool):
        self.doc, self.state, self.key, self.json = doc, state, key, is_json


def _is_state(value: Any) -> bool:
    return isinstance(value, dict) and ("segments" in value or value.get("kind") == "mixture")


def read_state_file(path: str, key: str | None = None) -> StateFile:
    """The loader state in ``path`` (at top-level ``key``, or found: the file itself, or the one
    top-level value that is a loader state); ShardtoolError naming the file and what it holds."""
    is_json = True
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        raise ShardtoolError(f"{path}: cannot read a loader state ({e})") from None
    except ValueError as e:  # not JSON (UnicodeDecodeError is one): a torch checkpoint?
        doc, is_json = _torch_checkpoint(path, e), False
    if key is not None:
        if not isinstance(doc, dict) or key not in doc:
            raise ShardtoolError(
                f"{path}: no key {key!r} at the top of the {'JSON object' if is_json else 'checkpoint'}"
            )
        return StateFile(doc, doc[key], key, is_json)
    if _is_state(doc) or not isinstance(doc, dict):
        return StateFile(doc, doc, None, is_json)
    found = [k for k, v in doc.items() if _is_state(v)]
    if len(found) == 1:
        return StateFile(doc, doc[found[0]], found[0], is_json)
    keys = ", ".join(map(repr, list(doc)[:20]))
    what = (
        "several loader states, at " + ", ".join(map(repr, found)) if found else f"no loader state at its top ({keys})"
    )
    raise ShardtoolError(f"{path}: the file holds {what}: give the one with --key NAME")


def _torch_checkpoint(path: str, why: Exception) -> Any:
    try:
        import torch

        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ShardtoolError(
            f"{path}: neither a JSON loader state ({why}) nor a torch checkpoint that torch.load(weights_only=True) "
            f"reads ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None
