"""A shard lock let go is free for the node, though a process forked while it was held still has
the descriptor (issue 38: a loader's workers forked while the trainer's fetch-ahead thread fetched
a shard kept its exclusive lock for their whole pass, and the node's other ranks waited on it)."""

from __future__ import annotations

import multiprocessing

import pytest

from shardtool.cache.locks import exclusive_unless, held_exclusively, locked, read_lock, try_exclusive


def _wait(done) -> None:
    done.wait(30)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["exclusive", "exclusive_unless", "shared"])
def test_a_lock_let_go_is_free_though_a_child_forked_inside_it_lives(tmp_path, how):
    path = str(tmp_path / "0.lock")
    ctx = multiprocessing.get_context("fork")
    done = ctx.Event()
    hold = {
        "exclusive": lambda: locked(path),
        "exclusive_unless": lambda: exclusive_unless(path, None),
        "shared": lambda: read_lock(path),
    }[how]
    with hold() as got:
        assert got
        child = ctx.Process(target=_wait, args=(done,))  # inherits the lock's descriptor
        child.start()
    try:
        assert child.is_alive()
        assert not held_exclusively(path)
        with try_exclusive(path) as free:  # an eviction or another rank's fetch goes ahead
            assert free
    finally:
        done.set()
        child.join(30)
    assert child.exitcode == 0
