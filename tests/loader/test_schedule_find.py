"""`find` in a scheduled run resumed onto another layout: every entry is where the run served it.

A batch-size ramp joins planned batches into steps and a sequence-length warmup cuts planned rows;
after an elastic resume the epoch's batches served on the first layout keep that layout's steps and
rows, and the re-dealt ones follow the new layout's. Checked against what the loaders delivered, on
real text as byte ids (long and short stdlib files)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import shardtool
from helpers.packedpieces import packed_pieces
from helpers.realtext import pack_long_and_short
from shardtool.loader import ShardedLoader
from shardtool.loader.trace import find


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return pack_long_and_short(str(tmp_path_factory.mktemp("schedfind") / "arrow"), 120, 90, least=200, shards=4)


SCHEDULED = {
    "ramp": dict(batch_size={0: 2, 4: 4, 9: 8}),
    "packed ramp": dict(batch_size={0: 1, 3: 2, 7: 4}, seq_len=256, token_fields=[]),
    "warmup": dict(batch_size=8, seq_len={0: 128, 5: 512}, token_fields=[]),
}


def _entries(batch, packed: bool) -> list[tuple]:
    if not packed:
        return [(str(k),) for k in batch["__key__"]]
    return [(row, key, offset) for row, key, offset in packed_pieces(batch)]


def _loader(url, rank, world, kind):
    return ShardedLoader(
        url, rank=rank, world_size=world, ranks_per_node=world, seed=5, num_workers=0, **SCHEDULED[kind]
    )


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", sorted(SCHEDULED))
@pytest.mark.parametrize("before,after,skip", [(2, 3, False), (3, 2, True)])
def test_find_after_an_elastic_resume_names_where_each_layout_served_the_sample(corpus, kind, before, after, skip):
    packed = "seq_len" in SCHEDULED[kind]
    seen: dict[str, list[tuple]] = {}
    state = None
    for rank in range(before):
        ld = _loader(corpus, rank, before, kind)
        for step, batch in zip(range(6), ld):
            for entry in _entries(batch, packed):
                seen.setdefault(entry[1 if packed else 0], []).append((0, rank, step, *entry))
        state = ld.state_dict() if rank == 0 else state
    resumed = []
    for rank in range(after):
        ld = _loader(corpus, rank, after, kind)
        ld.load_state_dict(json.loads(json.dumps(state)))
        start = len(ld) - ld.batches_left
        assert start == 6
        if skip:
            ld.skip_steps(start + 1, start + 3)
        for step, batch in enumerate(ld, start=start):
            for entry in _entries(batch, packed):
                seen.setdefault(entry[1 if packed else 0], []).append((1, rank, step, *entry))
        resumed.append(ld)
    ld = resumed[-1]
    ld.load_state_dict(json.loads(json.dumps(state)))  # the position right after the resume
    if skip:
        ld.skip_steps(7, 9)
    ds = shardtool.open_dataset(corpus)
    offsets = np.cumsum([0, *ds.shard_counts])
    later = 0
    for gid in range(len(ds)):
        shard = int(np.searchsorted(offsets, gid, side="right")) - 1
        key = ds.read(shard, gid - int(offsets[shard]))["__key__"]
        got = []
        for e in find(ld, gid):
            where = (e["row"], key, e["offset"]) if packed else (key,)
            got.append((e["segment"], e["dp_rank"], e["step"], *where))
        assert sorted(got) == sorted(seen.get(key, [])), key
        later += any(g[0] == 1 for g in got)
    assert later > 0 and any(s[0] == 0 for v in seen.values() for s in v)  # both layouts' steps were found
