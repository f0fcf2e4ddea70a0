"""ShardedLoader(shuffle=False) reads the dataset in plain order, as DistributedSampler(shuffle=False)
would; bucketing=True sorts by length again (issue 11, item 16)."""

from __future__ import annotations

import numpy as np
import pytest

from shardtool.format import open_dataset
from shardtool.loader import ShardedLoader
from test_loader_data import read_all, write_dataset


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset(str(tmp_path_factory.mktemp("order") / "d"), [13, 0, 9, 17, 11], seed=4)


@pytest.mark.parametrize("world, ranks_per_node", [(1, 1), (2, 2), (2, 1)])
def test_shuffle_false_yields_samples_in_dataset_order(dataset, world, ranks_per_node):
    root, keys = dataset
    loaders = [
        ShardedLoader(
            root, batch_size=4, shuffle=False, rank=r, world_size=world, ranks_per_node=ranks_per_node, num_workers=0
        )
        for r in range(world)
    ]
    per_rank = [read_all(ld) for ld in loaders]
    n = len(per_rank[0])
    assert all(len(b) == n for b in per_rank)
    # Within each data group (a node's ranks) the ranks take turns, batch by batch; groups read
    # consecutive ranges, so the groups one after another give the dataset in order.
    groups = [list(range(first, first + ranks_per_node)) for first in range(0, world, ranks_per_node)]
    order = [k for group in groups for i in range(n) for r in group for k in per_rank[r][i]]
    remainder = {keys[i] for ld in loaders for i in ld.remainder.tolist()}
    assert order == [k for k in keys if k not in remainder], "plain dataset order, less the remainder"


def test_bucketing_true_sorts_by_length_without_shuffling(dataset):
    root, keys = dataset
    lengths = open_dataset(root).lengths
    position = {k: i for i, k in enumerate(keys)}
    # One window covering the dataset: every served sample in one length order.
    ld = ShardedLoader(root, batch_size=4, shuffle=False, bucketing=True, window=len(keys), num_workers=0)
    order = [position[k] for b in read_all(ld) for k in b]
    assert order != sorted(order), "no longer dataset order"
    served = lengths[order]
    assert np.all(np.diff(served) <= 0), "longest first within the window"
    again = ShardedLoader(root, batch_size=4, shuffle=False, bucketing=True, window=len(keys), num_workers=0)
    assert [position[k] for b in read_all(again) for k in b] == order, "deterministic"
