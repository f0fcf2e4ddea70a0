"""The torchrun kill-and-resume run of `schedule_worker.py`, for the schedule tests."""

from __future__ import annotations

import json
import os

from .torchrun import torchrun


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
