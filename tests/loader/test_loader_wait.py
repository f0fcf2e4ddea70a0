"""``metrics()["wait_s"]`` is the time the training loop spends inside ``next()``, as a user measures it.

The user's side: a training loop with a short "step" (a sleep), timing every ``next()`` on the
loader, the one that ends the pass included. The loader's side must account for all of it: the
wait for a worker, the first call's start of the workers, unpacking, the metric line written
inside a step, closing the workers at the end. What is left is the Python call itself (a few
microseconds), so the test compares the *share* of the measured time the loader accounts for,
not wall-clock thresholds: workers slower than the step make every call wait milliseconds, and
``wait_s`` must be at least 97% of the measured time and never more (it is timed inside it).

Data: Python's stdlib sources read as byte ids, one document per file.
"""

from __future__ import annotations

import glob
import os
import sysconfig
import time

import numpy as np
import pytest

import shardtool
from helpers.skips import require
from shardtool.loader import Mixture, ShardedLoader

pytestmark = pytest.mark.timeout(180)
DOCS = 600
STEP_S = 0.002
PRODUCE_S = 0.0025  # per sample in a worker: a batch of 4 takes 10 ms, longer than the step


def stdlib_rows(n: int, skip: int = 0) -> list[dict]:
    paths = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), recursive=True))
    rows = []
    for p in paths[skip:]:
        with open(p, "rb") as f:
            data = f.read(8192)
        if data:
            rows.append({"tokens": np.frombuffer(data, np.uint8).astype(np.int32)})
        if len(rows) == n:
            return rows
    require(False, f"the stdlib here has fewer than {n + skip} .py files")


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    base = tmp_path_factory.mktemp("wait")
    out = {}
    for i, name in enumerate(("code", "more")):
        out[name] = str(base / name)
        shardtool.pack(
            stdlib_rows(DOCS, skip=i * DOCS), out[name], format="arrow", length="tokens", samples_per_shard=100
        )
    return out


def slow_transform(sample: dict) -> dict:
    time.sleep(PRODUCE_S)  # the worker's decode/augment: the trainer waits for it
    return sample


def timed_loop(loader) -> tuple[float, int]:
    """Seconds spent inside next() over one whole pass (StopIteration included), and the steps."""
    it = iter(loader)
    inside, steps = 0.0, 0
    while True:
        began = time.perf_counter()
        try:
            next(it)
        except StopIteration:
            inside += time.perf_counter() - began
            return inside, steps
        inside += time.perf_counter() - began
        steps += 1
        time.sleep(STEP_S)


@pytest.mark.parametrize("kind", ["dataset", "mixture"])
def test_wait_s_accounts_for_the_time_inside_next(roots, kind, tmp_path):
    opts = dict(
        batch_size=4,
        seed=3,
        num_workers=2,
        pin_memory=False,
        transform=slow_transform,
        metrics_every=1,
        metrics_dir=str(tmp_path),
    )  # a metric line inside every step
    if kind == "dataset":
        loader = ShardedLoader(roots["code"], **opts)
    else:
        loader = ShardedLoader(Mixture({"code": (roots["code"], 0.5), "more": (roots["more"], 0.5)}), steps=100, **opts)
    inside, steps = timed_loop(loader)
    c = loader.metrics()["cumulative"]
    loader.close()
    assert steps == c["batches"] and steps >= 100
    assert c["wait_s"] <= inside, (c["wait_s"], inside)  # timed within the user's own window
    assert c["wait_s"] >= 0.97 * inside, f"wait_s {c['wait_s']:.4f} s of {inside:.4f} s measured around next()"
    assert c["wait_s"] <= c["seconds"]
