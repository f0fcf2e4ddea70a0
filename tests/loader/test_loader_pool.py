"""The worker pool and its shared-memory slots: same batches as in-process, nothing left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from helpers.leaks import resources, settled
from shardtool.loader import LoaderError, ShardedLoader
from test_loader_data import write_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _as_lists(batches):
    return [(b["__key__"], b["tokens"].tolist(), b["lengths"].tolist()) for b in batches]


@pytest.mark.timeout(120)
def test_batches_do_not_depend_on_workers_or_prefetch_and_can_be_kept(tmp_path):
    root, _ = write_dataset(str(tmp_path / "d"), [40, 25, 33], lengths=np.arange(98) * 37 % 900 + 1)
    want = _as_lists(ShardedLoader(root, max_tokens=2048, num_workers=0, seed=3))
    for nw, pf in ((1, 1), (2, 2), (3, 3)):
        # Every batch is kept until the end: slots are reused, so a batch must not view one.
        kept = list(ShardedLoader(root, max_tokens=2048, num_workers=nw, prefetch_factor=pf, seed=3))
        assert _as_lists(kept) == want, (nw, pf)


def _big_and_small(sample):
    # Growing sizes make the slot grow mid-pass; small values travel pickled, large ones in the slot.
    n = int(sample["__key__"][1:]) + 1
    return {
        "__key__": sample["__key__"],
        "tokens": sample["tokens"],
        "big": torch.full((n * 500,), n, dtype=torch.float32),
        "arr": np.arange(n * 700, dtype=np.int16),
        "blob": bytes([n % 256]) * (n * 3000),
        "small": torch.tensor([n]),
        "bf": torch.ones(3, dtype=torch.bfloat16),
    }


@pytest.mark.timeout(120)
def test_transformed_batches_of_any_shape_cross_intact(tmp_path):
    root, _ = write_dataset(str(tmp_path / "d"), [30, 30])

    def collect(nw):
        out = []
        for b in ShardedLoader(root, batch_size=5, num_workers=nw, transform=_big_and_small):
            out.append(
                (
                    b["__key__"],
                    b["tokens"].tolist(),
                    [t.tolist() for t in b["big"]],
                    [a.tolist() for a in b["arr"]],
                    b["blob"],
                    [t.tolist() for t in b["small"]],
                    [t.float().tolist() for t in b["bf"]],
                )
            )
            assert all(type(a) is np.ndarray for a in b["arr"]) and all(type(x) is bytes for x in b["blob"])
        return out

    assert collect(2) == collect(0)


def _leak_case(root: str, case: str) -> None:
    if case == "end":
        list(ShardedLoader(root, batch_size=4, num_workers=2))
    elif case == "break":
        for _ in ShardedLoader(root, batch_size=4, num_workers=2):
            break
    elif case == "raise":
        with pytest.raises(ValueError):
            list(ShardedLoader(root, batch_size=4, num_workers=2, transform=_raise_on_21))
    elif case == "killed":
        with pytest.raises(LoaderError):
            list(ShardedLoader(root, batch_size=4, num_workers=2, transform=_die_on_21))


def _raise_on_21(sample):
    if sample["__key__"] == "s000021":
        raise ValueError("boom")
    return sample


def _die_on_21(sample):
    if sample["__key__"] == "s000021":
        os.kill(os.getpid(), signal.SIGKILL)
    return sample


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["end", "break", "raise", "killed"])
def test_nothing_is_left_behind(tmp_path, case):
    root, _ = write_dataset(str(tmp_path / "d"), [20, 20])
    before = resources()
    _leak_case(root, case)
    assert settled(before) == before  # /dev/shm entries, open descriptors, child processes


def _hang_on_21(sample):
    if sample["__key__"] == "s000021":
        time.sleep(600)
    return sample


@pytest.mark.timeout(60)
def test_a_hung_worker_times_out_naming_the_shards(tmp_path):
    root, _ = write_dataset(str(tmp_path / "d"), [20, 20])
    before = resources()
    began = time.monotonic()
    with pytest.raises(LoaderError) as info:
        list(ShardedLoader(root, batch_size=4, num_workers=2, transform=_hang_on_21, timeout=2, shuffle=False))
    assert time.monotonic() - began < 15
    assert "timed out" in str(info.value) and "shard-00001.tar" in str(info.value)
    assert settled(before) == before


@pytest.mark.timeout(60)
def test_workers_exit_when_the_trainer_is_killed(tmp_path):
    root, _ = write_dataset(str(tmp_path / "d"), [20, 20])
    script = textwrap.dedent(f"""
        import multiprocessing, time
        from shardtool.loader import ShardedLoader
        for b in ShardedLoader({root!r}, batch_size=2, num_workers=2):
            print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
            time.sleep(600)
    """)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.path.join(ROOT, "tests")}
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        workers = [int(p) for p in proc.stdout.readline().split()]
    finally:
        proc.kill()
        proc.wait(10)
    assert len(workers) >= 2
    deadline = time.monotonic() + 15
    while any(os.path.exists(f"/proc/{p}") for p in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(
        os.path.exists(f"/proc/{p}") and "Z" not in open(f"/proc/{p}/stat").read().split()[2] for p in workers
    )


def test_arrays_allocated_before_a_slot_grows_stay_writable():
    """A batch that outgrows its slot mid-batch: what was allocated before still reads and writes
    the slot (run in a child: the failure this guards against is a segfault)."""
    code = textwrap.dedent("""
        import numpy as np
        from shardtool.loader.shmring import INITIAL_SLOT_BYTES, Slot, decode, encode
        s = Slot()
        first = s.empty((INITIAL_SLOT_BYTES // 16,), np.int64)  # half the slot
        grown = s.empty((INITIAL_SLOT_BYTES,), np.int64)  # 8x the slot: it is remapped
        first[:] = 3
        grown[:] = 4
        back = decode(encode({"a": first, "b": grown, "c": first[::2]}, s), s)
        assert (back["a"] == 3).all() and (back["b"] == 4).all() and (back["c"] == 3).all()
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
