"""The loader reads through the node-local cache: warmed shards locally, misses fetched once.

The contract users rely on in a SLURM job: after the prolog warmed each node, training runs a
whole epoch from the node's cache even if the parallel filesystem goes away.
"""

from __future__ import annotations

import os
import shutil

import pytest

from shardtool import cache
from shardtool.loader import ShardedLoader
from shardtool.plan import DataLayout, Layout, Placement, shards_for_node
from test_loader_data import read_all, write_dataset

pytestmark = pytest.mark.timeout(120)

SHARDS = [37, 5, 60, 22, 41, 13, 50, 8, 33, 29, 44, 17, 26, 35]  # 14 uneven shards on 2 nodes


def _loaders(url, cache_dirs, **kw):
    return [
        ShardedLoader(
            url,
            max_tokens=256,
            seed=3,
            rank=r,
            world_size=4,
            ranks_per_node=2,
            num_workers=0,
            cache_dir=cache_dirs[r // 2] if cache_dirs else None,
            **kw,
        )
        for r in range(4)
    ]


def test_two_nodes_run_an_epoch_from_their_caches_with_the_source_gone(tmp_path):
    src, keys = write_dataset(str(tmp_path / "src"), SHARDS)
    caches = [str(tmp_path / f"node{n}" / "cache") for n in range(2)]
    for c in caches:
        os.makedirs(os.path.dirname(c))  # the node's local disk; warm refuses to invent a mount point
    for n in range(2):
        report = cache.warm(src, caches[n], placement=Placement(Layout(2, 2), n), progress=False)
        assert report.exit_code == 0, report.summary()
    expected = [read_all(ld) for ld in _loaders(src, None)]

    shutil.move(src, str(tmp_path / "moved-away"))  # the parallel filesystem is gone
    loaders = _loaders(src, caches)
    got = [read_all(ld) for ld in loaders]

    assert got == expected  # same batches as reading the source directly
    assert len({len(b) for b in got}) == 1 and len(got[0]) == len(loaders[0])
    seen = [k for rank in got for batch in rank for k in batch]
    remainder = {keys[i] for i in loaders[0].remainder}
    assert len(seen) == len(set(seen))
    assert set(seen) | remainder == set(keys)


def test_only_the_nodes_own_shards_are_cached(tmp_path):
    src, _ = write_dataset(str(tmp_path / "src"), SHARDS)
    cdir = str(tmp_path / "cache")
    cache.warm(src, cdir, placement=Placement(Layout(2, 2), 1), progress=False)
    dc = cache.open_cache(src, cdir)
    ds = dc.dataset
    mine = set(shards_for_node(ds.summaries, DataLayout.pure_dp(Layout(2, 1)), 1))
    cached = {i for i in range(len(SHARDS)) if dc.is_cached(i)}
    assert cached == mine and 0 < len(mine) < len(SHARDS)


def test_a_shard_missing_from_the_cache_is_fetched_into_it_on_demand(tmp_path):
    src, keys = write_dataset(str(tmp_path / "src"), SHARDS)
    cdir = str(tmp_path / "cache")
    cache.warm(src, cdir, placement=Placement(Layout(2, 2), 0), progress=False)  # node 0's shards only
    # A rank of node 1 reading through this cache must fetch its shards on demand.
    ld = ShardedLoader(
        src, max_tokens=256, seed=3, rank=2, world_size=4, ranks_per_node=2, num_workers=0, cache_dir=cdir
    )
    direct = ShardedLoader(src, max_tokens=256, seed=3, rank=2, world_size=4, ranks_per_node=2, num_workers=0)
    expected = read_all(direct)
    assert read_all(ld) == expected
    dc = cache.open_cache(src, cdir)
    ds = dc.dataset
    node1 = shards_for_node(ds.summaries, DataLayout.pure_dp(Layout(2, 1)), 1)
    assert all(dc.is_cached(i) for i in node1)
    # ...and once fetched, the source is no longer needed for them.
    shutil.move(src, str(tmp_path / "gone"))
    again = ShardedLoader(
        src, max_tokens=256, seed=3, rank=2, world_size=4, ranks_per_node=2, num_workers=2, cache_dir=cdir
    )
    assert read_all(again) == expected
