"""Fault suite: a read that never returns becomes an error naming the shard, the offset and the tier.

Two real ways a read blocks forever: a shard that is a FIFO nobody writes (``open`` blocks in
the kernel, the way a hung NFS or FUSE mount does) and a remote store that accepted the request
and went silent (tests/helpers/faultfs.py ``hang``). Both with the trainer reading (``num_workers=0``:
the main thread itself is stuck in C code) and with two workers; each must fail within
``stall_timeout`` plus a few seconds and leave the stacks of every process in the dump file.
"""

from __future__ import annotations

import os
import re
import threading
import time

import numpy as np
import pytest

from helpers import faultfs  # noqa: F401  registers faulty://
from shardtool.format import open_dataset
from shardtool.loader import LoaderError, ShardedLoader
from test_loader_data import write_dataset

pytestmark = pytest.mark.timeout(90)
STALL = 2.0
SLACK = 6.0  # seconds past stall_timeout: the stack dumps, and the pool's 2 s grace before a kill
HUNG = "shard-00002.tar"


def stalled(loader) -> tuple[LoaderError, float]:
    began = time.monotonic()
    with pytest.raises(LoaderError) as info:
        for _ in loader:
            pass
    return info.value, time.monotonic() - began


def dump_of(err: LoaderError) -> str:
    path = re.search(r"worker\(s\): (\S+\.log)", str(err)).group(1)
    with open(path) as f:
        return f.read()


def first_read_of_hung_shard(root: str, loader) -> tuple[int, int]:
    """(batch, byte offset) of the first sample of the hung shard this rank reads, in plan order."""
    ds = open_dataset(root)
    start = int(ds.manifest.shard_offsets()[2])
    for b in range(len(loader)):
        ids = loader.plan.batch(b)
        inside = ids[(ids >= start) & (ids < start + ds.manifest.shards[2].samples)]
        if len(inside):
            return b, int(ds.shard_index(2).offsets[int(inside[0]) - start])
    raise AssertionError("the plan never reads the hung shard")


@pytest.mark.parametrize("workers", [0, 2])
def test_a_fifo_shard_stalls_into_an_error_with_stacks(tmp_path, workers):
    root, _ = write_dataset(str(tmp_path / "d"), [30, 25, 40, 20], seed=4)
    os.unlink(os.path.join(root, HUNG))
    os.mkfifo(os.path.join(root, HUNG))  # open(O_RDONLY) blocks until a writer comes: none will
    ld = ShardedLoader(root, batch_size=6, num_workers=workers, stall_timeout=STALL, metrics_dir=str(tmp_path / "m"))
    err, took = stalled(ld)
    msg = str(err)
    assert STALL <= took < STALL + SLACK, msg
    assert "rank 0/1" in msg and f"stall_timeout={STALL:g} s" in msg
    assert f"opening shard {HUNG} at byte offset 0" in msg and "(tier local)" in msg
    assert ("worker " if workers else "the trainer") in msg
    dump = dump_of(err)
    assert dump.startswith("rank 0/1") and os.path.dirname(re.search(r"(\S+\.log)", msg).group(1)) == str(
        tmp_path / "m"
    )
    if workers:
        for w in range(workers):  # every worker answered with its own stacks, stuck in the open
            part = dump.split(f"--- worker {w} (pid ")[1]
            assert "in map_shard" in part.split("--- worker")[0]
    else:
        assert "in map_shard" in dump  # the trainer's main thread, blocked in the kernel's open


@pytest.mark.parametrize("workers", [0, 2])
def test_a_silent_remote_store_stalls_into_an_error_naming_the_offset(tmp_path, workers):
    root, _ = write_dataset(str(tmp_path / "d"), [30, 25, 40, 20], seed=4)
    ld = ShardedLoader(
        "faulty://" + root,
        batch_size=6,
        num_workers=workers,
        stall_timeout=STALL,
        storage_options={"hang": [HUNG]},
        metrics_dir=str(tmp_path / "m"),
    )
    batch, offset = first_read_of_hung_shard(root, ld)
    err, took = stalled(ld)
    msg = str(err)
    assert STALL <= took < STALL + SLACK, msg
    assert f"batch {batch} was not delivered" in msg
    assert re.search(rf"reading shard {HUNG} at byte offset {offset}, \d+ bytes \(tier remote\)", msg), msg
    assert "faultfs.py" in dump_of(err)


def test_without_metrics_the_watchdog_still_fires_and_dumps(tmp_path):
    root, _ = write_dataset(str(tmp_path / "d"), [30, 25, 40, 20], seed=4)
    os.unlink(os.path.join(root, HUNG))
    os.mkfifo(os.path.join(root, HUNG))
    ld = ShardedLoader(
        root, batch_size=6, num_workers=2, stall_timeout=STALL, metrics=False, metrics_dir=str(tmp_path / "m")
    )
    err, took = stalled(ld)
    assert took < STALL + SLACK and "no read details (metrics=False)" in str(err)
    assert "in map_shard" in dump_of(err)


def test_a_pass_in_another_thread_fails_at_the_pool_timeout_with_the_stall_report(tmp_path):
    # Signals reach only the main thread: the stall is declared (and dumped) at stall_timeout,
    # and the error comes when the pool's own timeout ends the wait.
    root, _ = write_dataset(str(tmp_path / "d"), [30, 25, 40, 20], seed=4)
    os.unlink(os.path.join(root, HUNG))
    os.mkfifo(os.path.join(root, HUNG))
    ld = ShardedLoader(
        root, batch_size=6, num_workers=2, stall_timeout=STALL, timeout=STALL + 2, metrics_dir=str(tmp_path / "m")
    )
    out: dict = {}

    def loop():
        try:
            out["err"], out["took"] = stalled(ld)
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            out["other"] = e

    t = threading.Thread(target=loop)
    t.start()
    t.join(60)
    assert "other" not in out and not t.is_alive(), out
    assert out["took"] < STALL + 2 + SLACK
    assert f"opening shard {HUNG}" in str(out["err"]) and "in map_shard" in dump_of(out["err"])


def test_a_slow_batch_within_the_limit_is_not_a_stall(tmp_path):
    root, _ = write_dataset(str(tmp_path / "d"), [30, 25, 40, 20], seed=4)
    ld = ShardedLoader(
        "faulty://" + root,
        batch_size=6,
        num_workers=0,
        stall_timeout=3.0,
        storage_options={"latency": 0.2},
        metrics_dir=str(tmp_path / "m"),
    )
    it = iter(ld)
    # 6 sample reads of 0.2 s each (and, before the first, the pass's 4 shard indexes, fetched
    # at once): at most 2 s a batch, under the limit
    slow = []
    while ld.metrics()["cumulative"]["wait_s"] <= 3.5 and len(slow) < 12:  # the batches together: slow
        slow.append(next(it))
    assert sum(len(b["__key__"]) for b in slow) == ld.metrics()["cumulative"]["samples"]
    assert ld.metrics()["cumulative"]["wait_s"] > 3.5  # past the limit together, not one by one
    assert not (tmp_path / "m").exists()  # no dump, and no metric line before step 100


def _hang_on_s000050(sample):
    if sample["__key__"] == "s000050":
        time.sleep(3600)
    return sample


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stall_outside_any_read_names_where_the_batch_begins(tmp_path, workers):
    # Not a read: a transform that never returns. The error says so, and where the batch's reading began.
    root, keys = write_dataset(str(tmp_path / "d"), [30, 25, 40, 20], seed=4)
    ld = ShardedLoader(
        root,
        batch_size=6,
        num_workers=workers,
        stall_timeout=STALL,
        transform=_hang_on_s000050,
        metrics_dir=str(tmp_path / "m"),
    )
    ds = open_dataset(root)
    gid = keys.index("s000050")
    b = next(i for i in range(len(ld)) if gid in ld.plan.batch(i).tolist())
    first = int(ld.plan.batch(b)[0])
    offs = ds.manifest.shard_offsets()
    s = int(np.searchsorted(offs, first, side="right") - 1)
    offset = int(ds.shard_index(s).offsets[first - int(offs[s])])
    err, took = stalled(ld)
    msg = str(err)
    assert took < STALL + SLACK and f"inside batch {b} for" in msg, msg
    assert f"batch {b} begins at shard {ds.manifest.shards[s].path} byte offset {offset} (tier local)" in msg
    assert "_hang_on_s000050" in dump_of(err)
