"""A run stopped after some batches: what each rank served, and the state it saved there."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def served_then_saved(loaders: Sequence[Any], cut: int, record: Callable[[Any], Any]) -> tuple[list, list]:
    """Per loader: ``record`` of each of its first ``cut`` batches, and its ``state_dict()`` after
    them; its pass and the loader closed, as a run stopped there would be."""
    done, states = [], []
    for ld in loaders:
        it = iter(ld)
        done.append([record(next(it)) for _ in range(cut)])
        states.append(ld.state_dict())
        it.close()
        ld.close()
    return done, states
