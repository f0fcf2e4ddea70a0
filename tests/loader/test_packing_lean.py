"""Lean packed batches (``packed_outputs="lean"``): the same rows as the full batch, with labels and
positions derived on the device by `lean_to_full`; and the worker slot handing a block's planes over
without copying them."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardtool
from helpers.data_gen import packed_rows_dataset
from helpers.realtext import byte_ids, stdlib_files
from shardtool.loader import ShardedLoader
from shardtool.loader.packed import PackedReader, lean_dtype, lean_to_full, packed_batch
from shardtool.loader.reader import BatchReader
from shardtool.loader.shmring import InSlot, Slot, decode, encode
from shardtool.loader.source import SourceSpec
from shardtool.plan.mixture import Mixture
from shardtool.plan.packing import Packing, pack_rows
from shardtool.plan.synthetic import lognormal_lengths
from test_loader_data import write_dataset

TENSORS = ("input_ids", "labels", "position_ids", "cu_seqlens", "lengths")


def assert_lean_matches_full(lean: dict, full: dict, name: str = "input_ids") -> None:
    """Same tokens; lean_to_full gives back every tensor of the full batch, equal and int64."""
    assert "__key__" not in lean and "labels" not in lean and "position_ids" not in lean
    assert lean[name].dtype in (torch.int32, torch.int64)
    assert torch.equal(lean[name].to(torch.int64), full[name])
    assert lean["max_seqlen"] == full["max_seqlen"]
    derived = lean_to_full(lean, name=name)
    for key in (name, "labels", "position_ids", "cu_seqlens", "lengths", "doc_offsets"):
        assert derived[key].dtype == full[key].dtype, key
        assert torch.equal(derived[key], full[key]), key


@st.composite
def cases(draw):
    seq = draw(st.integers(2, 40))
    lengths = np.asarray(draw(st.lists(st.integers(0, 2 * seq + 3), min_size=1, max_size=40)), dtype=np.int64)
    packing = Packing(
        seq,
        draw(st.sampled_from(["concat", "best-fit", "no-split", "stream"])),
        eos_id=draw(st.sampled_from([None, 1])),
        max_docs_per_row=draw(st.sampled_from([None, 2, 5])),
    )
    rows = pack_rows(lengths, packing)
    chosen = draw(st.lists(st.integers(0, max(rows.num_rows - 1, 0)), max_size=4)) if rows.num_rows else []
    dtype = draw(st.sampled_from(["i4", "u2", "i8"]))
    return lengths, packing, rows.take(np.asarray(chosen, np.int64)), draw(st.integers(0, 2)), dtype


@settings(max_examples=200, deadline=None)
@given(cases())
def test_lean_batch_has_the_full_batch_tokens_and_derives_the_rest(case):
    lengths, packing, rows, extra, dtype = case
    tokens = lambda ids: [((np.arange(lengths[g]) * 7 + g) % 90 + 2).astype(dtype) for g in ids]
    b = rows.num_rows + extra
    full = packed_batch(rows, tokens, packing, rows_per_batch=b, pad_id=0)
    lean = packed_batch(rows, tokens, packing, rows_per_batch=b, pad_id=0, outputs="lean")
    if rows.span_pos.size:  # without documents there is no stored dtype to follow
        assert lean["input_ids"].dtype == (torch.int64 if dtype == "i8" else torch.int32)
    assert_lean_matches_full(lean, full)


def test_lean_dtype():
    assert lean_dtype(np.dtype("i4"), 0, 2) == np.int32
    assert lean_dtype(np.dtype("u2"), 0, None) == np.int32
    assert lean_dtype(np.dtype("u1")) == np.int32
    assert lean_dtype(np.dtype("u4")) == np.int64  # may hold ids past int32
    assert lean_dtype(np.dtype("i8")) == np.int64
    assert lean_dtype(np.dtype("i4"), 2**31) == np.int64  # a pad id int32 cannot hold


@pytest.mark.parametrize("fmt, dtype", [("tar", "i4"), ("arrow", "u2"), ("arrow", "i8")])
def test_reader_lean_equals_full_on_mapped_shards(tmp_path, fmt, dtype):
    ds, _, packing, rows = packed_rows_dataset(str(tmp_path / "ds"), fmt, dtype)
    reader = BatchReader(SourceSpec(ds.root), pad_id=7)
    full = PackedReader(reader, packing, name="tokens", pad_id=7)
    lean = PackedReader(reader, packing, name="tokens", pad_id=7, outputs="lean")
    for sel in (np.arange(8), np.arange(rows.num_rows - 5, rows.num_rows), np.array([3, 1, 4, 1])):
        got = lean.read(rows.take(sel), rows_per_batch=len(sel) + 1)
        assert got["tokens"].dtype == (torch.int64 if dtype == "i8" else torch.int32)
        assert_lean_matches_full(got, full.read(rows.take(sel), rows_per_batch=len(sel) + 1), name="tokens")
    with pytest.raises(ValueError, match="lean batch has none"):
        lean.read(rows.take(np.arange(2)), into=np.empty((3, 2, 64), np.int64))
    reader.close()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    lengths = lognormal_lengths(2400, seed=5, median=60, high=700)
    root, _ = write_dataset(str(tmp_path_factory.mktemp("lean") / "ds"), [600] * 4, lengths=lengths, extra=False)
    return root


def _run(loader) -> list[dict]:
    return [dict(b) for b in loader]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("policy", ["best-fit", "concat"])
def test_loader_lean_with_workers_matches_full_and_is_deterministic(corpus, policy):
    kw = dict(seq_len=256, batch_size=3, packing=policy, eos_id=1, seed=7, world_size=2, ranks_per_node=2, rank=1)
    full = _run(ShardedLoader(corpus, num_workers=0, **kw))
    for workers in (0, 2):
        lean = _run(ShardedLoader(corpus, num_workers=workers, packed_outputs="lean", **kw))
        assert len(lean) == len(full) > 5
        for a, b in zip(lean, full):
            assert_lean_matches_full(a, b)
    again = _run(ShardedLoader(corpus, num_workers=2, packed_outputs="lean", **kw))
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(again, lean))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("saved, resumed", [("full", "lean"), ("lean", "full"), ("lean", "lean")])
def test_a_state_resumes_across_outputs(corpus, saved, resumed):
    kw = dict(seq_len=256, batch_size=2, packing="best-fit", eos_id=1, seed=3)
    whole = _run(ShardedLoader(corpus, num_workers=0, **kw))
    ld = ShardedLoader(corpus, num_workers=2, packed_outputs=saved, **kw)
    it = iter(ld)
    for _ in range(7):
        next(it)
    state = json.loads(json.dumps(ld.state_dict()))
    it.close()
    again = ShardedLoader(corpus, num_workers=0, packed_outputs=resumed, **kw)
    again.load_state_dict(state)
    rest = _run(again)
    assert len(rest) == len(whole) - 7
    for got, want in zip(rest, whole[7:]):
        assert torch.equal(got["input_ids"].to(torch.int64), want["input_ids"])
        assert torch.equal(got["cu_seqlens"], want["cu_seqlens"])


@pytest.mark.timeout(240)
def test_real_text_lean_equals_full(tmp_path):
    """The stdlib's files as byte ids: most longer than a row, so split documents and full rows."""
    rows = [{"tokens": byte_ids(p), "path": os.path.relpath(p)} for p in stdlib_files(300)]
    shardtool.pack(rows, str(tmp_path / "ds"), format="arrow", length="tokens", shard_size=4_000_000)
    kw = dict(seq_len=1024, batch_size=4, packing="concat", eos_id=256, seed=1)
    full = _run(ShardedLoader(str(tmp_path / "ds"), num_workers=0, **kw))
    lean = _run(ShardedLoader(str(tmp_path / "ds"), num_workers=2, packed_outputs="lean", **kw))
    assert len(lean) == len(full) > 10
    for a, b in zip(lean, full):
        assert a["input_ids"].dtype == torch.int32  # the loader names the packed tokens input_ids
        assert_lean_matches_full(a, b)


def test_lean_is_refused_where_it_does_not_apply(corpus):
    with pytest.raises(ValueError, match="packed_outputs must be"):
        ShardedLoader(corpus, seq_len=64, batch_size=2, packed_outputs="thin")
    with pytest.raises(ValueError, match="give seq_len"):
        ShardedLoader(corpus, batch_size=2, packed_outputs="lean")
    with pytest.raises(ValueError, match="outputs must be one of"):
        PackedReader(BatchReader(SourceSpec(corpus)), Packing(64, "concat"), outputs="thin")
    with pytest.raises(ValueError, match="for one dataset"):
        ShardedLoader(
            Mixture({"a": (corpus, 0.5), "b": (corpus, 0.5)}), seq_len=64, batch_size=2, steps=4, packed_outputs="lean"
        )


def test_a_view_inside_a_slot_allocation_is_handed_over_without_a_copy():
    slot = Slot()
    try:
        slot.reset()
        block = slot.empty((3, 4, 1000), np.int64)
        block[:] = np.arange(12_000).reshape(3, 4, 1000)
        used = slot.used
        enc = encode({"a": torch.from_numpy(block[0]), "b": torch.from_numpy(block[1]), "c": block[2]}, slot)
        assert slot.used == used, "no copy of the block's planes into the slot"
        assert [type(v) for v in enc.values()] == [InSlot] * 3
        assert enc["b"].offset - enc["a"].offset == 4 * 1000 * 8
        out = decode(enc, slot)
        assert torch.equal(out["b"], torch.from_numpy(block[1].copy()))
        assert np.array_equal(out["c"], block[2])
        strided = slot.empty((4, 1000), np.int64)  # not contiguous: copied, as before
        enc = encode({"s": strided[:, ::2]}, slot)
        assert slot.used > used and isinstance(enc["s"], InSlot)
    finally:
        slot.close()
