"""Soak: several epochs of a 2-rank training job (both ranks' loaders stepped in lock-step in one
process, as DDP steps them) killed (SIGKILL, whole process group) at random batch counts
and resumed each time from the last state it saved; the batches served must be exactly the
uninterrupted run's. Slow: run it with `python -m pytest tests/faults/test_soak.py -m slow -q -s`.

The trainer appends one line per batch holding the batch's keys and the state after it, in one
write: a checkpoint that is never ahead of or behind the batches it covers. A kill can tear only
the last line, which the driver cuts off before resuming.
"""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from test_loader_data import write_dataset

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EPOCHS = 6
# 2 ranks on one node under a token budget: the remainder changes every epoch (8 to 50 samples)
WORLD = 2
CONFIG = {
    "max_tokens": 200,
    "seed": 9,
    "pin_memory": False,
    "prefetch_factor": 2,
    "world_size": WORLD,
    "ranks_per_node": 2,
}

TRAINER = r"""
import json, os, sys, time
sys.path[:0] = [sys.argv[1]]
from shardtool.loader import ShardedLoader
a = json.loads(sys.argv[2])
lds = [ShardedLoader(a["root"], **a["config"], rank=r, num_workers=a["num_workers"]) for r in range(a["world"])]
if a["state"] is not None:
    for ld in lds:
        ld.load_state_dict(a["state"])
ld = lds[0]
fd = os.open(a["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
def emit(rec):
    os.write(fd, (json.dumps(rec) + "\n").encode())  # one write: a kill leaves it whole or torn at the end
for epoch in range(ld.epoch, a["epochs"]):
    for x in lds:
        x.set_epoch(epoch)
    emit({"epoch": epoch, "remainder": ld.remainder.tolist(), "lens": [len(x) for x in lds]})
    for batches in zip(*lds):
        states = [x.state_dict() for x in lds]
        if any(st != states[0] for st in states):
            sys.exit(f"ranks' states differ: {states}")
        emit({"step": epoch, "keys": [list(b["__key__"]) for b in batches], "state": states[0]})
        time.sleep(a["step_seconds"])  # a training step
emit({"done": True})
"""


def read_log(path: str) -> list[dict]:
    """Complete records; a torn last line (killed mid-write) is cut off the file."""
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        data = f.read()
    whole = data[: data.rfind(b"\n") + 1]
    if len(whole) != len(data):
        os.truncate(path, len(whole))
    return [json.loads(line) for line in whole.splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_random_kills_and_resumes_serve_exactly_the_uninterrupted_run(tmp_path):
    from shardtool.loader import ShardedLoader

    rng = random.Random(20240601)
    root, keys = write_dataset(str(tmp_path / "d"), [97, 3, 0, 150, 61, 88, 120, 29], seed=21)
    log = str(tmp_path / "train.log")
    began = time.monotonic()
    kills = starts = 0
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    while True:
        records = read_log(log)
        if records and records[-1].get("done"):
            break
        steps = [r for r in records if "step" in r]
        state = steps[-1]["state"] if steps else None
        args = {
            "root": root,
            "config": CONFIG,
            "num_workers": rng.choice([0, 2]),
            "state": state,
            "log": log,
            "epochs": EPOCHS,
            "world": WORLD,
            "step_seconds": rng.choice([0.0, 0.005, 0.02]),
        }
        proc = subprocess.Popen(
            [sys.executable, "-c", TRAINER, REPO, json.dumps(args)],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        starts += 1
        target = len(steps) + rng.randint(1, 20)
        try:
            while proc.poll() is None:
                now = read_log(log)
                if sum(1 for r in now if "step" in r) >= target and not (now and now[-1].get("done")):
                    os.killpg(proc.pid, signal.SIGKILL)  # the trainer and its DataLoader workers
                    kills += 1
                    break
                time.sleep(rng.choice([0.005, 0.02, 0.05]))
            _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        assert proc.returncode in (0, -signal.SIGKILL), f"trainer failed (start {starts}):\n{err[-3000:]}"
        assert starts < 200, "no progress"

    records = read_log(log)
    served: dict[int, list[list[list[str]]]] = collections.defaultdict(list)  # epoch -> step -> rank -> keys
    remainders: dict[int, list[str]] = {}
    for rec in records:
        if "step" in rec:
            served[rec["step"]].append(rec["keys"])
        elif "remainder" in rec:
            assert len(set(rec["lens"])) == 1, f"epoch {rec['epoch']}: unequal batch counts {rec['lens']}"
            rem = [keys[g] for g in rec["remainder"]]
            assert remainders.setdefault(rec["epoch"], rem) == rem, f"epoch {rec['epoch']}: remainder changed on resume"

    total = collections.Counter()
    for epoch in range(EPOCHS):
        refs = [ShardedLoader(root, **CONFIG, rank=r, num_workers=0) for r in range(WORLD)]
        for ref in refs:
            ref.set_epoch(epoch)
        expected = [[[keys[g] for g in b.tolist()] for b in ref.plan.batches()] for ref in refs]
        assert [list(step) for step in zip(*expected)] == served[epoch], (
            f"epoch {epoch}: batches differ from the uninterrupted run"
        )
        flat = [k for step in served[epoch] for b in step for k in b]
        assert sorted(flat + remainders[epoch]) == sorted(keys), f"epoch {epoch}: a sample lost or repeated"
        total.update(flat)
    expected_total = collections.Counter({k: EPOCHS for k in keys})
    expected_total.subtract(collections.Counter(k for e in range(EPOCHS) for k in remainders[e]))
    assert total == +expected_total
    assert kills >= 3, f"only {kills} kills: the soak did not exercise resume"
    summary = {
        "epochs": EPOCHS,
        "kills": kills,
        "starts": starts,
        "samples": sum(total.values()),
        "dataset": len(keys),
        "remainders": {e: len(r) for e, r in remainders.items()},
        "seconds": round(time.monotonic() - began, 1),
    }
    print("\nsoak:", json.dumps(summary))
