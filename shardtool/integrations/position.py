"""Where a loader is, in the terms a trainer counts in: (epoch, batches this rank had in it).
From the loader's state alone, so every adapter agrees. The epoch's length in the same terms is
``len(loader)``: the whole epoch, the batches of its earlier segments (layouts it ran on before an
elastic resume) included, since a trainer restores its count of the batches done and ends the
epoch when that count reaches ``len()``.
"""

from __future__ import annotations

from typing import Any

from ..plan.schedule import StepClock
from ..plan.state import LoaderState

__all__ = ["one_dataset", "position"]


def position(loader: Any) -> tuple[int, int]:
    """(epoch, batches this rank has had in it): where the next batch comes from. Read through
    the state's own parser: the saved JSON is the loader's edge, not a format adapters know.
    Under a schedule by step a batch is a step, which takes several planned batches: counted in
    steps (`shardtool.plan.schedule.StepClock`), as the trainer and ``len()`` count them."""
    state = LoaderState.from_dict(loader.state_dict())
    schedule = getattr(loader, "schedule", None)
    if schedule is None or state.step is None:
        return state.epoch, state.served
    return state.epoch, StepClock(schedule, int(state.step)).steps(state)[0]


def one_dataset(loader: Any, adapter: str, why: str) -> Any:
    """``loader`` if it is a ShardedLoader of one dataset (an adapter follows its epochs), else
    TypeError naming ``adapter`` and ``why`` the trainer needs epochs."""
    from ..loader import ShardedLoader

    if not isinstance(loader, ShardedLoader):
        raise TypeError(f"{adapter} wraps a ShardedLoader, found {type(loader).__name__}")
    if loader.mixture is not None:
        raise TypeError(
            f"a ShardedLoader of a Mixture has no epochs, and {why}: {adapter} takes a ShardedLoader of one dataset"
        )
    return loader
