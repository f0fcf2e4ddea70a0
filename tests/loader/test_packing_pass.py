"""Packed rows through the loader, on real text (stdlib files as byte ids): with drop_last=False a
pass serves every document whole, its pieces head first (by step, then rank), each piece's offset
in its document in ``doc_offsets`` (full and lean batches alike); with drop_last=True the loader
reports the tokens it leaves out."""

from __future__ import annotations

import collections
import os

import numpy as np
import pytest
import torch

import shardtool
from helpers.realtext import byte_ids, stdlib_files
from shardtool.loader import ShardedLoader

EOS = 256


@pytest.fixture(scope="module")
def stdlib_dataset(tmp_path_factory):
    paths = stdlib_files(400)
    rows = [{"tokens": byte_ids(p), "path": os.path.relpath(p)} for p in paths]
    root = str(tmp_path_factory.mktemp("packed") / "d")
    shardtool.pack(rows, root, format="arrow", length="tokens", shard_size=1_000_000)
    return root, [r["tokens"] for r in rows]


def _pieces(batch):
    """(key, offset in its document, tokens) of every piece of a full batch, in batch order."""
    cu, offsets = batch["cu_seqlens"].tolist(), batch["doc_offsets"].tolist()
    flat = batch["input_ids"].reshape(-1)
    seq = batch["input_ids"].shape[1]
    ends = [r * seq + int(n) for r, n in enumerate(batch["lengths"].tolist())]
    keys = [k for row in batch["__key__"] for k in row]
    out = []
    for i, off in enumerate(o for o in offsets if o >= 0):
        stop = min(cu[i + 1], ends[cu[i] // seq])
        out.append((keys[i], off, flat[cu[i] : stop].tolist()))
    assert len(out) == len(keys), "one offset per piece"
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world, seq_len", [(1, 1024), (2, 1024), (3, 256)])
def test_a_pass_serves_every_document_whole_head_first(stdlib_dataset, world, seq_len):
    root, docs = stdlib_dataset
    kw = dict(seq_len=seq_len, batch_size=4, packing="best-fit", eos_id=EOS, seed=5, world_size=world)
    kw.update(drop_last=False, num_workers=0)
    loaders = [ShardedLoader(root, rank=r, **kw) for r in range(world)]
    lean = [ShardedLoader(root, rank=r, packed_outputs="lean", **kw) for r in range(world)]
    assert len({len(ld) for ld in loaders}) == 1
    got: dict = collections.defaultdict(list)
    for step in zip(*loaders, *lean):
        for r in range(world):  # ranks in order within a step
            full, thin = step[r], step[world + r]
            assert torch.equal(full["doc_offsets"], thin["doc_offsets"])
            for key, off, tokens in _pieces(full):
                assert off == sum(len(t) for t in got[key]), f"{key}: piece at {off} out of order"
                got[key].append(tokens)
    assert all(ld.remainder_tokens == 0 and ld.remainder_pieces == 0 for ld in loaders)
    served = collections.Counter(tuple(sum(t, [])) for t in got.values())
    assert served == collections.Counter(tuple(d.tolist()) + (EOS,) for d in docs), "every document, whole, once"


@pytest.mark.timeout(300)
def test_drop_last_reports_the_tokens_it_leaves_out(stdlib_dataset):
    root, docs = stdlib_dataset
    kw = dict(seq_len=1024, batch_size=4, packing="best-fit", seed=5, world_size=3, drop_last=True, num_workers=0)
    loaders = [ShardedLoader(root, rank=r, **kw) for r in range(3)]
    left = loaders[0].remainder_tokens  # one data group: every rank reports its remainder (this epoch's)
    pieces, whole = loaders[0].remainder_pieces, loaders[0].remainder
    assert left > 0 and all(ld.remainder_tokens == left for ld in loaders)
    served = sum(int(b["lengths"].sum()) for ld in loaders for b in ld)
    assert served + left == sum(len(d) for d in docs)
    assert pieces >= 1 and whole.size <= pieces and np.isin(whole, np.arange(len(docs))).all()
