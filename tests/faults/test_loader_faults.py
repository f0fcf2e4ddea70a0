"""Fault suite, loader on one rank: resume at every awkward point, and workers that hang or die.

Resume is checked against the stream of an uninterrupted run over two epochs: the keys of
every batch, in order, including across the epoch boundary. The training loop is the usual
one (`load_state_dict`, then `for epoch in range(state epoch, E): set_epoch(epoch); for b in
loader`), the state always goes through JSON, and once through a fresh process. Multi-rank
faults (a rank's worker failing while the others wait in a collective) are in test_ddp_faults.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardtool.loader import LoaderError, ShardedLoader
from test_loader_data import write_dataset

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EPOCHS = 2
CONFIG = {"batch_size": 4, "seed": 3, "pin_memory": False}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    # 53 samples in uneven shards (one empty): 14 batches of at most 4, split to fit
    return write_dataset(str(tmp_path_factory.mktemp("resume") / "d"), [17, 9, 0, 22, 5], seed=11)


def make(root, num_workers=0, **kw):
    return ShardedLoader(root, **CONFIG, num_workers=num_workers, **kw)


def train(loader, stop=None):
    """The training loop: batches as (epoch, keys) until `stop` batches or the end of EPOCHS; and the state."""
    got = []
    if stop == 0:
        return got, json.loads(json.dumps(loader.state_dict()))
    for epoch in range(loader.epoch, EPOCHS):
        loader.set_epoch(epoch)
        for batch in loader:
            got.append((epoch, list(batch["__key__"])))
            if len(got) == stop:
                return got, json.loads(json.dumps(loader.state_dict()))
    return got, json.loads(json.dumps(loader.state_dict()))


def resumed_run(root, cuts, workers):
    """Run `cuts[i]` batches on a loader with `workers[i]` workers, save, resume on the next; then to the end."""
    stream, state = [], None
    for i, cut in enumerate([*cuts, None]):
        ld = make(root, workers[i % len(workers)])
        if state is not None:
            ld.load_state_dict(state)
        got, state = train(ld, cut)
        stream += got
        ld.close()
    return stream, state


@pytest.fixture(scope="module")
def full(dataset):
    stream, state = train(make(dataset[0]))
    return stream, state


def per_epoch(dataset):
    return len(make(dataset[0]))


def test_uninterrupted_reference_is_sane(dataset, full):
    stream, state = full
    n = per_epoch(dataset)
    assert n == 14 and len(stream) == EPOCHS * n
    assert state["epoch"] == EPOCHS and state["segments"][-1]["served"] == 0


NAMED = {
    "batch 0": lambda n: [0],
    "mid-epoch": lambda n: [n // 2],
    "last batch": lambda n: [n - 1],
    "exact epoch end": lambda n: [n],
    "two resumes in a row, same epoch": lambda n: [3, 0, 2],
    "two resumes in a row, across the epoch end": lambda n: [n - 2, 3],
    "resume, then exact epoch end again": lambda n: [n, n],
}


# every point with num_workers 0; the worker-count change 0 <-> 2 at three of them (worker start-up is slow)
POINT_WORKERS = [(p, (0,)) for p in NAMED] + [
    (p, w) for p in ("mid-epoch", "last batch", "two resumes in a row, across the epoch end") for w in ((0, 2), (2, 0))
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "point,workers", POINT_WORKERS, ids=[f"{p}-nw{'-to-'.join(map(str, w))}" for p, w in POINT_WORKERS]
)
def test_resume_at_named_points_matches_the_uninterrupted_stream(dataset, full, point, workers):
    n = per_epoch(dataset)
    stream, state = resumed_run(dataset[0], NAMED[point](n), workers)
    assert stream == full[0]
    assert state == full[1]


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(cuts=st.lists(st.integers(0, 29), min_size=1, max_size=3))
def test_any_chain_of_resume_points_matches_the_uninterrupted_stream(dataset, full, cuts):
    stream, state = resumed_run(dataset[0], cuts, (0,))
    assert stream == full[0]


def test_a_state_at_served_equals_len_continues_at_the_next_epoch(dataset, full):
    # state_dict never writes it (it says "next epoch, 0 served"), but a hand-edited or older
    # state may: it is the same position.
    n = per_epoch(dataset)
    st0 = make(dataset[0]).state_dict()
    st0["segments"][-1]["served"] = n
    ld = make(dataset[0])
    ld.load_state_dict(st0)
    assert ld.epoch == 1 and ld.batches_left == len(ld) == n
    stream, _ = train(ld)
    assert stream == full[0][n:]


FRESH = r"""
import json, sys
sys.path[:0] = [sys.argv[1]]
from shardtool.loader import ShardedLoader
a = json.loads(sys.argv[2])
ld = ShardedLoader(a["root"], **a["config"], num_workers=2)
with open(a["state"]) as f:
    ld.load_state_dict(json.load(f))
out = []
for epoch in range(ld.epoch, a["epochs"]):
    ld.set_epoch(epoch)
    out += [[epoch, list(b["__key__"])] for b in ld]
print(json.dumps(out))
"""


@pytest.mark.timeout(120)
def test_a_state_saved_here_resumes_in_a_fresh_process(dataset, full, tmp_path):
    n = per_epoch(dataset)
    got, state = train(make(dataset[0], 2), n // 2 + 1)
    path = tmp_path / "state.json"
    path.write_text(json.dumps(state))
    args = {"root": dataset[0], "config": CONFIG, "state": str(path), "epochs": EPOCHS}
    res = subprocess.run(
        [sys.executable, "-c", FRESH, REPO, json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=100,
        env={**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rest = [(e, keys) for e, keys in json.loads(res.stdout)]
    assert got + rest == full[0]


@pytest.mark.timeout(60)
def test_resume_on_three_simulated_ranks_at_the_last_batch(dataset):
    loaders = [make(dataset[0], rank=r, world_size=3) for r in range(3)]
    n = len(loaders[0])
    ref = [train(make(dataset[0], rank=r, world_size=3))[0] for r in range(3)]
    states = [train(ld, n - 1)[1] for ld in loaders]
    assert all(s == states[0] for s in states)
    for r in range(3):
        ld = make(dataset[0], rank=r, world_size=3)
        ld.load_state_dict(states[0])
        assert train(ld)[0] == ref[r][n - 1 :]


# --------------------------------------------------------------------------- workers that fail
@pytest.mark.timeout(60)
def test_a_hung_worker_is_an_error_naming_the_batch_within_the_timeout(dataset):
    root, keys = dataset
    probe = make(root)
    bad = keys[int(probe.plan.batches()[1][0])]

    def hang(sample):
        if sample["__key__"] == bad:
            time.sleep(3600)
        return sample

    ld = make(root, 2, timeout=2, transform=hang)
    began = time.monotonic()
    with pytest.raises(LoaderError) as info:
        train(ld)
    took = time.monotonic() - began
    # 2 s of timeout, then up to 5 s while the DataLoader waits for the hung worker to exit
    assert took < 2 + 5 + 4, took
    msg = str(info.value)
    assert "rank 0/1" in msg and "batch 1" in msg and "timed out" in msg and "shard-" in msg, msg
    assert bad in _where(root, bad) and _where(root, bad).split(" ")[0] in msg, msg


def _where(root, key):
    """'shard-x.tar#i key' for a key of the test dataset."""
    from shardtool.format import open_dataset

    ds = open_dataset(root)
    for s in range(len(ds.manifest.shards)):
        for i, k in enumerate(ds.shard_index(s).keys):
            if k == key:
                return f"{ds.manifest.shards[s].path}#{i} {key}"
    raise KeyError(key)


def _kill_on(kill_key, slow_key):
    def transform(sample):
        if sample["__key__"] == slow_key:
            time.sleep(3)
        if sample["__key__"] == kill_key:
            os.kill(os.getpid(), signal.SIGKILL)
        return sample

    return transform


@pytest.mark.timeout(60)
def test_a_killed_worker_fails_the_rank_within_seconds(dataset):
    root, keys = dataset
    batches = make(root).plan.batches()
    ld = make(root, 2, transform=_kill_on(keys[int(batches[2][0])], keys[int(batches[1][0])]))
    began = time.monotonic()
    with pytest.raises(LoaderError, match=r"rank 0/1, epoch 0: batch \d+ could not be loaded.*killed"):
        train(ld)
    assert time.monotonic() - began < 10


@pytest.mark.timeout(60)
def test_a_killed_worker_error_names_the_batch_it_was_reading(dataset):
    root, keys = dataset
    batches = make(root).plan.batches()
    # Worker 0 reads batches 0 and 2, worker 1 batch 1 (slow): worker 0 dies while batch 1 is awaited.
    bad = keys[int(batches[2][0])]
    ld = make(root, 2, transform=_kill_on(bad, keys[int(batches[1][0])]))
    with pytest.raises(LoaderError) as info:
        train(ld)
    msg = str(info.value)
    assert "batch 2" in msg and _where(root, bad).split(" ")[0] in msg, msg


@pytest.mark.timeout(60)
def test_a_worker_killed_during_the_training_step_is_a_loader_error(dataset):
    root, keys = dataset
    # batch 6 is handed to a worker when the trainer takes batch 2 (2 workers x prefetch 2 in flight):
    # read, and the worker killed, while the trainer sleeps in its step
    bad = keys[int(make(root).plan.batches()[6][0])]
    ld = make(root, 2, transform=_kill_on(bad, None))
    with pytest.raises(LoaderError, match=r"rank 0/1, epoch 0: batch \d+"):
        for _ in ld:
            time.sleep(1.0)  # the training step
