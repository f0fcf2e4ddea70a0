"""What an elastic resume leaves over is not lost: the next epoch serves it.

A resume onto fewer DP ranks deals the epoch's unserved whole batches in equal shares; fewer than
the new DP size are left to no rank in that epoch (equal counts, or DDP hangs). The epoch after
is planned afresh on the new layout, so those samples come back there like every other sample,
unless the next epoch's own (rotating) remainder takes them. Real document lengths (the stdlib's
files, clipped) and the README's case: 4 ranks -> 3 at half an epoch."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.realtext import stdlib_lengths
from shardtool.loader import ShardedLoader
from test_loader_data import read_all, write_dataset


@pytest.mark.timeout(300)
@pytest.mark.parametrize("batching", [{"batch_size": 16}, {"max_tokens": 8192}])
def test_samples_a_4_to_3_resume_leaves_over_are_served_the_next_epoch(tmp_path, batching):
    lengths = np.minimum(stdlib_lengths()[:900], 2048)
    root, keys = write_dataset(str(tmp_path / "d"), [150] * 6, lengths=lengths, extra=False)

    def ranks(world):
        return [
            ShardedLoader(root, rank=r, world_size=world, ranks_per_node=1, num_workers=0, **batching)
            for r in range(world)
        ]

    before = ranks(4)
    served0 = []
    for ld in before:
        it = iter(ld)
        for _ in range(len(ld) // 2):
            served0 += next(it)["__key__"]
        it.close()
    after = ranks(3)
    for ld in after:
        ld.load_state_dict(before[0].state_dict())
    left = sorted({keys[i] for b in after[0].planner.left_over(after[0].batch_source.state) for i in b.tolist()})
    assert left, "this case leaves batches over (else the test shows nothing)"
    for ld in after:
        served0 += [k for b in read_all(ld) for k in b]
    assert not set(left) & set(served0)
    # The end of the resumed epoch is the start of the next one on the new layout.
    states = [ld.state_dict() for ld in after]
    assert all(s["epoch"] == 1 and s["segments"][-1]["served"] == 0 for s in states)
    served1 = {k for ld in after for b in read_all(ld) for k in b}
    remainder1 = {keys[i] for ld in after for i in ld.remainder.tolist()}
    assert served1 | remainder1 == set(keys) and not served1 & remainder1
    assert set(left) - remainder1 <= served1
    assert len(set(left) & served1) >= len(left) - len(remainder1)


@pytest.mark.timeout(300)
def test_with_drop_last_false_what_a_resume_leaves_over_is_reported_and_warned(tmp_path, caplog):
    """3 ranks -> 2 with drop_last=False: the batches the re-deal leaves over were served by no
    rank and reported nowhere (`loader.remainder` empty, no warning). Now every rank's
    `remainder` lists their samples, served + remainder is the whole epoch, and DP rank 0 warns."""
    lengths = np.minimum(stdlib_lengths()[:665], 2048)
    root, keys = write_dataset(str(tmp_path / "d"), [133] * 5, lengths=lengths, extra=False)

    def ranks(world):
        return [
            ShardedLoader(
                root, rank=r, world_size=world, ranks_per_node=1, num_workers=0, batch_size=4, drop_last=False
            )
            for r in range(world)
        ]

    before = ranks(3)
    served = []
    for ld in before:
        it = iter(ld)
        for _ in range(20):
            served += next(it)["__key__"]
        it.close()
    after = ranks(2)
    with caplog.at_level("WARNING", logger="shardtool"):
        for ld in after:
            ld.load_state_dict(before[0].state_dict())
        left = [{keys[i] for i in ld.remainder.tolist()} for ld in after]
    assert left[0] and left[0] == left[1], "the same leftover, named on every rank"
    warned = [r.getMessage() for r in caplog.records if "not served this epoch" in r.getMessage()]
    assert len(warned) == 1 and "exact=True" in warned[0], warned
    for ld in after:
        served += [k for b in read_all(ld) for k in b]
    assert len(served) == len(set(served)), "nothing served twice"
    assert set(served) | left[0] == set(keys) and not set(served) & left[0]
