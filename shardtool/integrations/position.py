"""Where a loader is, in the terms a trainer counts in: (epoch, batches this rank had in it) and
the epoch's length in batches. From the loader's state alone, so every adapter agrees.

A trainer restores its own batch counter to the batches done and ends the epoch when that counter
reaches ``len()``: the length it needs is the whole epoch's — the batches served in the epoch's
earlier segments (layouts it ran on before an elastic resume) plus the current segment's count —
not what is left of it, which is what ``len(ShardedLoader)`` says.
"""

from __future__ import annotations

from typing import Any

__all__ = ["epoch_length", "one_dataset", "position"]


def position(loader: Any) -> tuple[int, int]:
    """(epoch, batches this rank has had in it): where the next batch comes from."""
    state = loader.state_dict()
    return state["epoch"], sum(s["served"] for s in state["segments"])


def epoch_length(loader: Any) -> int:
    """The batches of the loader's current epoch on this rank, as a trainer counts them."""
    segments = loader.state_dict()["segments"]
    return sum(s["served"] for s in segments[:-1]) + segments[-1]["batches"]


def one_dataset(loader: Any, adapter: str, why: str) -> Any:
    """``loader`` if it is a ShardedLoader of one dataset (an adapter follows its epochs), else
    TypeError naming ``adapter`` and ``why`` the trainer needs epochs."""
    from ..loader import ShardedLoader
    from ..loader.mixed import MixtureLoader

    if not isinstance(loader, ShardedLoader):
        raise TypeError(f"{adapter} wraps a ShardedLoader, found {type(loader).__name__}")
    if isinstance(loader, MixtureLoader):
        raise TypeError(
            f"a ShardedLoader of a Mixture has no epochs, and {why}: {adapter} takes a ShardedLoader of one dataset"
        )
    return loader
