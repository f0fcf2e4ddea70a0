"""The torchrun kill-and-resume run of `schedule_worker.py`, for the schedule tests."""

from __future__ import annotations

import json
import os

from hypothesis import strategies as st

from .torchrun import torchrun

# Where a schedule's resume tests draw their changes' gaps, layouts before and after, workers,
# the step the state is saved at and the seed (the values to schedule are each test's own).
RESUME_DRAWS = dict(
    gaps=st.lists(st.integers(1, 10), min_size=3, max_size=3),
    world=st.integers(1, 3),
    world_after=st.integers(1, 3),
    workers=st.sampled_from([0, 2]),
    stop=st.integers(0, 40),
    seed=st.integers(0, 3),
)


def killed_and_resumed(data: str, out: str, *extra: str) -> tuple[dict, list[tuple[dict, dict]]]:
    """2 ranks run the epoch whole; again, rank 1 killed with SIGKILL at step 8, rank 0 saving the
    state after every step; then resumed from the last state saved. Returns (what was saved, per
    rank (the whole run's steps, the resumed run's)); each run must end as it should."""

    def launch(phase: str, ok: bool = True) -> None:
        res = torchrun("schedule_worker.py", 2, "--data", data, "--out", out, "--phase", phase, *extra, timeout=200)
        assert (res.returncode == 0) == ok, res.stderr[-4000:]

    launch("whole")
    launch("killed", ok=False)
    with open(os.path.join(out, "state.json")) as f:
        saved = json.load(f)
    launch("resumed")
    runs = []
    for r in range(2):
        with open(os.path.join(out, f"whole.rank{r}.json")) as f, open(os.path.join(out, f"resumed.rank{r}.json")) as g:
            runs.append((json.load(f), json.load(g)))
    return saved, runs


def changes_of(values: list[int], gaps: list[int]) -> dict[int, int]:
    """A schedule by step from hypothesis' draws: ``values[0]`` from step 0, each next value
    ``gaps[i]`` steps after the one before."""
    changes, step = {0: values[0]}, 0
    for value, gap in zip(values[1:], gaps):
        step += gap
        changes[step] = value
    return changes


def state_after(loaders: list, stop: int) -> dict:
    """Every rank's loader run ``stop`` steps, and the state they save: one state, the same on every
    rank, and JSON."""
    its = [iter(ld) for ld in loaders]
    for it in its:
        for _ in range(stop):
            next(it)
    state = loaders[0].state_dict()
    assert all(ld.state_dict() == state for ld in loaders)  # one state, every rank
    json.dumps(state)
    return state
