"""Lean packed batches laid out a chunk of batches at a time (`shardtool.loader.packchunk`) are the
batches `PackedReader.read` builds one by one: every policy, eos stored or added, short batches,
rows of padding, several ranks, on real text (the stdlib's files and small /usr/share/doc files as
byte ids) and in tar and Arrow shards. And data that disagrees with the plan is still named."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardtool
from helpers.realtext import byte_ids, doc_files, stdlib_files
from helpers.skips import require
from shardtool.format import FormatError
from shardtool.loader import ShardedLoader
from shardtool.loader.packchunk import CHUNK
from shardtool.loader.packed import PackedReader
from shardtool.loader.reader import BatchReader
from shardtool.loader.source import SourceSpec
from shardtool.pack.synthetic import write_synthetic
from shardtool.plan.packing import Packing, pack_rows


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """The same 900 documents (300 stdlib files, 600 small doc files, mixed) four ways: Arrow with
    a stored eos (256), Arrow and tar without (the loader adds it), and Arrow as uint16."""
    small = [p for p in doc_files() if 0 < os.path.getsize(p) < 2048][:600]
    require(len(small) >= 200, "too few small files under /usr/share/doc")
    paths = stdlib_files(300) + small
    order = np.random.default_rng(1).permutation(len(paths))
    docs = [byte_ids(paths[i]) for i in order]
    base = tmp_path_factory.mktemp("chunk")
    out = {}
    for name, fmt, eos, dtype in [
        ("arrow-eos", "arrow", True, np.int32),
        ("arrow", "arrow", False, np.int32),
        ("tar", "tar", False, np.int32),
        ("arrow-u16", "arrow", False, np.uint16),
    ]:
        rows = [{"tokens": (np.append(d, 256) if eos else d).astype(dtype)} for d in docs]
        root = str(base / name)
        shardtool.pack(rows, root, format=fmt, length="tokens", shard_size=2_000_000)
        out[name] = (root, None if eos else 256)
    return out


def _equal(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    name=st.sampled_from(["arrow-eos", "arrow", "tar", "arrow-u16"]),
    seq=st.sampled_from([256, 1024, 8192]),
    per_batch=st.integers(1, 8),
    policy=st.sampled_from(["stream", "concat", "best-fit", "no-split"]),
    world=st.integers(1, 3),
    drop_last=st.booleans(),
    seed=st.integers(0, 3),
)
def test_chunked_lean_batches_are_the_batches_read_one_by_one(
    corpora, name, seq, per_batch, policy, world, drop_last, seed
):
    root, eos = corpora[name]
    rank = seed % world
    loader = ShardedLoader(
        root,
        seq_len=seq,
        batch_size=per_batch,
        packing=policy,
        eos_id=eos,
        seed=seed,
        world_size=world,
        rank=rank,
        drop_last=drop_last,
        packed_outputs="lean",
        metrics=False,
    )
    plan = loader.plan
    one = PackedReader(BatchReader(SourceSpec(root)), loader.packing, rows_per_batch=per_batch, outputs="lean")
    got = list(loader)
    assert len(got) == plan.batches_per_rank
    for b, batch in enumerate(got):
        _equal(batch, one.read(plan.batch_rows(b)))
    one.reader.close()


@pytest.mark.timeout(240)
def test_chunked_with_workers_and_a_resume_in_mid_chunk(corpora):
    root, _ = corpora["arrow-eos"]
    kw = dict(seq_len=256, batch_size=2, packing="stream", seed=2, packed_outputs="lean")
    whole = list(ShardedLoader(root, num_workers=0, **kw))
    assert len(whole) > CHUNK + 10, "the pass spans chunks"
    ld = ShardedLoader(root, num_workers=2, **kw)
    it = iter(ld)
    at = CHUNK + 5
    for _ in range(at):
        next(it)
    state = ld.state_dict()
    it.close()
    again = ShardedLoader(root, num_workers=2, **kw)
    again.load_state_dict(state)
    rest = list(again)
    assert len(rest) == len(whole) - at
    for a, b in zip(rest, whole[at:]):
        _equal(a, b)


def test_data_that_disagrees_with_the_plan_names_its_batch_and_sample(tmp_path):
    """The plan says sample 2 has 9 tokens, its shard holds 3: batch 0 (samples 0 and 1) is read,
    batch 1 (sample 2) is the error naming the sample, as reading one by one says it."""
    ds = write_synthetic(str(tmp_path / "ds"), lengths=np.array([5, 4, 3]), shard_sizes=[3])
    packing = Packing(9, "stream")
    rows = pack_rows(np.array([5, 4, 9]), packing)
    assert rows.num_rows == 2
    reader = PackedReader(BatchReader(SourceSpec(ds.root)), packing, rows_per_batch=1, outputs="lean")
    offsets = np.array([0, 1, 2])
    _equal(reader.read_planned(rows, offsets, 0), reader.read(rows.slice(0, 1)))
    with pytest.raises(FormatError, match=r"shard .* sample #2 has 3 tokens, but the plan packs its tokens up to 9"):
        reader.read_planned(rows, offsets, 1)
    reader.reader.close()
