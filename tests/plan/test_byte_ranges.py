"""Datasets whose length is a byte size (images, file trees) are cut into the data groups' ranges by
sample count, so that every rank's batches hold ``batch_size`` samples.

Found by packing the real Adwaita icons as an ImageFolder tree (`shardtool pack --label-from-dir`):
cut by bytes, one node's classes of larger PNGs gave it fewer samples, and equal batch counts
split its batches, so at 4 nodes x 8 ranks and ``batch_size=32`` ranks served 84 to 208 images an
epoch, 40% of the batches full. A PNG's bytes are no measure of its work once decoded and resized.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shardtool
from helpers.realdata import ICONS
from helpers.skips import require
from shardtool.format import open_dataset
from shardtool.loader import ShardedLoader
from shardtool.loader.errors import LoaderStateError
from shardtool.plan import ArraySource, Batching, DataLayout, Layout, Planner, group_cuts


@pytest.fixture(scope="module")
def icons(tmp_path_factory):
    """Every PNG of the icon theme (every size, 11 categories as classes; ~4.8k files), packed."""
    from shardtool.benchmarks.image_corpus import build_tree

    require(os.path.isdir(ICONS), f"real PNG icons not installed ({ICONS} is absent)")
    root = tmp_path_factory.mktemp("icons")
    build_tree(str(root / "tree"))
    shardtool.pack([str(root / "tree")], str(root / "ds"), format="arrow", label_from_dir=True, samples_per_shard=500)
    return str(root / "ds")


class _CutBy:
    """A plan source's lengths with its ranges cut by samples or (``by_samples=False``: as before
    the fix) by the weight of its byte lengths."""

    def __init__(self, ds, by_samples: bool = False):
        self.ds, self.summaries = ds, dataclasses.replace(ds.summaries, by_samples=by_samples)

    def lengths_range(self, lo: int, hi: int) -> np.ndarray:
        return self.ds.lengths_range(lo, hi)


def _batch_sizes(source, layout: Layout, size: int) -> list[np.ndarray]:
    """Every DP rank's batch sizes (samples) in epoch 0, each rank planning as a loader does."""
    data = DataLayout.pure_dp(layout)
    planner = Planner(source, Batching(batch_size=size, bucketing=False))
    state = planner.start(0, "v", data)
    return [np.diff(planner.rank_plan(state, d).offsets) for d in range(data.dp_size)]


@pytest.mark.parametrize("layout", [Layout(2, 4), Layout(2, 8), Layout(4, 8)])
@pytest.mark.parametrize("size", [16, 32])
def test_image_ranks_serve_full_batches(icons, layout, size):
    ds = open_dataset(icons)
    assert ds.manifest.length["unit"] == "bytes" and ds.summaries.by_samples
    got = _batch_sizes(ds, layout, size)
    served = np.array([s.sum() for s in got])
    # Equal counts on every rank, and equal samples within a batch's worth: the few short batches
    # are the equal-count fit's (a group's last batch, and the splits that fill its count).
    assert len({s.size for s in got}) == 1
    assert served.max() - served.min() <= size, (served.min(), served.max())
    assert np.mean(np.concatenate(got) == size) >= 0.85
    before = _batch_sizes(_CutBy(ds), layout, size)
    spread = max(s.sum() for s in before) - min(s.sum() for s in before)
    assert spread > size  # what the cut by bytes did to these images: the test can fail


def test_a_loader_of_images_serves_full_batches_and_the_warmer_caches_its_shards(icons):
    from shardtool.cache.assign import assigned_shards
    from shardtool.plan import Placement

    layout = Layout(2, 4)
    rank = 5  # node 1
    ld = ShardedLoader(icons, batch_size=16, rank=rank, world_size=8, ranks_per_node=4, num_workers=0, seed=2)
    batches = list(ld)
    sizes = [len(b["__key__"]) for b in batches]
    served_keys = [k for b in batches for k in b["__key__"]]
    assert len(sizes) == len(ld) and sum(s == 16 for s in sizes) >= len(sizes) - 1
    ds = open_dataset(icons)
    node_shards = assigned_shards(ds.summaries, Placement(layout, 1))  # what `shardtool warm` copies
    where = {
        str(k.decode() if isinstance(k, bytes) else k): s for s in range(ds.num_shards) for k in ds.shard_index(s).keys
    }
    read = {where[k] for k in served_keys}
    assert read <= set(node_shards)


def test_a_state_saved_when_image_ranges_were_cut_by_bytes_is_refused(icons, tmp_path):
    kw = dict(batch_size=16, rank=0, world_size=4, ranks_per_node=2, num_workers=0)
    ld = ShardedLoader(icons, **kw)
    it = iter(ld)
    next(it)
    state = ld.state_dict()
    ld.close()
    assert state["dataset_fingerprint"].endswith("/ranges=samples")
    state["dataset_fingerprint"] = state["dataset_fingerprint"].removesuffix("/ranges=samples")  # as 0.2.0 saved it
    fresh = ShardedLoader(icons, **kw)
    with pytest.raises(LoaderStateError, match=r"cut this dataset .* by bytes.*loader\.set_epoch"):
        fresh.load_state_dict(json.loads(json.dumps(state)))
    fresh.close()


def test_a_state_saved_at_an_epoch_end_before_the_sample_cut_loads_into_the_next_epoch(icons):
    kw = dict(batch_size=16, rank=1, world_size=4, ranks_per_node=2, num_workers=0)
    ld = ShardedLoader(icons, **kw)
    first = [b["__key__"] for b in ld]
    state = ld.state_dict()  # the epoch served whole: the state is the start of epoch 1
    assert state["epoch"] == 1
    ld.set_epoch(1)
    want = [b["__key__"] for b in ld]
    ld.close()
    state["dataset_fingerprint"] = state["dataset_fingerprint"].removesuffix("/ranges=samples")  # as 0.2.0 saved it
    fresh = ShardedLoader(icons, **kw)
    fresh.load_state_dict(json.loads(json.dumps(state)))
    got = [b["__key__"] for b in fresh]
    assert got == want and got != first and len(got) == len(fresh)
    assert fresh.state_dict()["dataset_fingerprint"].endswith("/ranges=samples")  # saved under the new cut
    fresh.close()


def test_a_mixture_state_of_image_sources_cut_by_bytes_is_refused_naming_the_source(icons):
    from shardtool.plan.mixture import Mixture

    mixture = Mixture({"icons": (icons, 0.5), "again": (icons, 0.5)})
    kw = dict(steps=12, batch_size=8, rank=0, world_size=2, ranks_per_node=1, num_workers=0)
    ld = ShardedLoader(mixture, **kw)
    next(iter(ld))
    saved = json.dumps(ld.state_dict())
    ld.close()
    fresh = ShardedLoader(mixture, **kw)
    with pytest.raises(LoaderStateError, match=r"mixture source 'icons': .*cut this dataset .* by bytes"):
        fresh.load_state_dict(json.loads(saved.replace("/ranges=samples", "")))
    fresh.load_state_dict(json.loads(saved))  # as saved now: resumes
    fresh.close()


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 5000), min_size=40, max_size=400),
    per_shard=st.integers(5, 60),
    nodes=st.integers(1, 4),
    per_node=st.integers(1, 4),
    size=st.integers(1, 8),
)
def test_sample_cut_ranges_keep_equal_counts_and_serve_each_sample_once(lengths, per_shard, nodes, per_node, size):
    """The cut by sample count under the plan's guarantees, on byte-like lengths: every group's
    share within one sample of its part, equal batch counts, no sample served twice, and a resume
    on another world size (the elastic re-deal) from the same cuts."""
    lengths = np.array(lengths)
    counts = [per_shard] * (lengths.size // per_shard) + (
        [lengths.size % per_shard] if lengths.size % per_shard else []
    )
    src = _CutBy(ArraySource(lengths, counts), by_samples=True)
    layout = Layout(nodes, per_node)
    data = DataLayout.pure_dp(layout)
    cuts = group_cuts(src.summaries, data.group_sizes)
    share = np.diff(cuts)
    assert cuts[0] == 0 and cuts[-1] == lengths.size and (share >= 0).all()
    assert np.abs(share - lengths.size * np.array(data.group_sizes) / data.dp_size).max() < 1
    if lengths.size < data.dp_size * size:
        return
    planner = Planner(src, Batching(batch_size=size, bucketing=False))
    state = planner.start(0, "v", data)
    plans = [planner.rank_plan(state, d) for d in range(data.dp_size)]
    assert len({p.batches_per_rank for p in plans}) == 1
    served = np.concatenate([p.ids for p in plans])
    assert np.unique(served).size == served.size
    half = dataclasses.replace(state, segments=[dataclasses.replace(state.last, served=plans[0].batches_per_rank // 2)])
    other = DataLayout.pure_dp(Layout(1, 1 + (data.dp_size % 3)))
    resumed = planner.continue_on(half, other)
    later = np.concatenate([planner.rank_plan(resumed, d).ids for d in range(other.dp_size)])
    first = np.concatenate([p.ids[: p.offsets[half.last.served]] for p in plans])
    assert not set(first.tolist()) & set(later.tolist())  # nothing served before is served again
