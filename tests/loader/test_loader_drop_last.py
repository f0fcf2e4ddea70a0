"""A batch-size run serves every sample where nothing needs equalising (one DP rank), or when asked
(drop_last=False); the 0.2% balanced surplus only where ranks must be evened out, or when asked."""

from __future__ import annotations

import numpy as np
import pytest

from shardtool.loader import ShardedLoader
from test_loader_data import write_dataset


def _served(root, world: int, **kw) -> list[str]:
    keys = []
    for r in range(world):
        ld = ShardedLoader(root, batch_size=7, num_workers=0, rank=r, world_size=world, ranks_per_node=1, **kw)
        keys += [k for b in ld for k in b["__key__"]]
    return keys


@pytest.mark.parametrize("world, kw", [(1, {}), (3, {"drop_last": False})])
def test_every_sample_once(tmp_path, world, kw):
    # 600 full batches and one of a single sample, which the balanced rule would leave out.
    lengths = np.random.default_rng(3).integers(1, 400, 4201)
    root, keys = write_dataset(str(tmp_path / "d"), [1500, 1500, 1201], lengths=lengths)
    served = _served(root, world, **kw)
    assert sorted(served) == sorted(keys)


def test_drop_last_true_keeps_the_balanced_rule_on_one_rank(tmp_path):
    # 600 full batches and one of a single sample: that one is within the 0.2% the rule may leave out.
    root, keys = write_dataset(str(tmp_path / "d"), [1500, 1500, 1201])
    ld = ShardedLoader(root, batch_size=7, num_workers=0, drop_last=True)
    served = [k for b in ld for k in b["__key__"]]
    assert len(set(served)) == len(served) and len(served) + ld.remainder.size == len(keys)
    assert len(served) < len(keys)
