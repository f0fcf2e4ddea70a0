"""``packing="stream"``: the stored token stream cut into rows, only the rows shuffled (LitData's
``TokensLoader``, Megatron's GPT datasets). On real text (the stdlib's files as byte ids, each
ending in its stored eos) a row is a run of neighbouring documents, read in one copy where its
tokens lie side by side in the shard; every token is served once an epoch; resume is exact."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardtool
from helpers.realtext import byte_ids, doc_files, doc_lengths, stdlib_files, stdlib_lengths
from helpers.skips import require
from helpers.strategies import LAYOUTS
from shardtool.loader import ShardedLoader
from shardtool.loader.packed import PackedReader
from shardtool.loader.packlayout import BatchLayout, joined_runs
from shardtool.loader.reader import BatchReader
from shardtool.loader.source import SourceSpec
from shardtool.plan import ArraySource, Batching, DataLayout, Layout, Planner
from shardtool.plan.packing import Packing

EOS = 256  # byte ids are 0..255


@pytest.fixture(scope="module")
def stdlib_ds(tmp_path_factory):
    """300 stdlib files and 900 small /usr/share/doc files (under 2 KB) as byte ids + a stored eos,
    mixed in a fixed order, in Arrow shards of ~1 MB (several shards, so rows cross shard
    boundaries); keys are the pack order (000000042)."""
    small = [p for p in doc_files() if 0 < os.path.getsize(p) < 2048][:900]
    require(len(small) >= 300, "too few small files under /usr/share/doc")
    paths = stdlib_files(300) + small
    order = np.random.default_rng(0).permutation(len(paths))
    docs = [np.append(byte_ids(paths[i]), EOS).astype(np.int32) for i in order]
    root = str(tmp_path_factory.mktemp("stream") / "ds")
    shardtool.pack([{"tokens": d} for d in docs], root, format="arrow", length="tokens", shard_size=1_000_000)
    return root, docs


def _pieces(batch: dict) -> list[list[tuple[int, int, int, int]]]:
    """Per row: (document, offset in it, start in the row, tokens) of each piece, from the batch's
    own ``__key__``, ``doc_offsets`` and ``cu_seqlens``."""
    b, seq = batch["input_ids"].shape
    cu, offs = batch["cu_seqlens"].tolist(), batch["doc_offsets"].tolist()
    real = batch["lengths"].tolist()
    out, k = [], 0
    for r in range(b):
        row = []
        for key in batch["__key__"][r]:
            start = cu[k] - r * seq
            end = min(cu[k + 1] - r * seq, real[r])  # the row's padding is its last piece's tail
            row.append((int(key), offs[k], start, end - start))
            k += 1
        out.append(row)
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("seq_len", [256, 2048, 8192])
def test_rows_are_runs_of_stored_neighbours_with_their_tokens(stdlib_ds, seq_len):
    root, docs = stdlib_ds
    loader = ShardedLoader(root, seq_len=seq_len, batch_size=3, packing="stream", seed=5, drop_last=False)
    served = np.zeros(len(docs), np.int64)
    for batch in loader:
        ids = batch["input_ids"]
        for r, row in enumerate(_pieces(batch)):
            if not row:
                continue
            # A row's documents were stored one after another (a split document's pieces keep
            # their places, their offsets re-cut so that they are served head first).
            keys = [d for d, _, _, _ in row]
            assert keys == list(range(keys[0], keys[0] + len(keys))), "a row is stored neighbours"
            for d, off, at, n in row:
                assert torch.equal(ids[r, at : at + n], torch.from_numpy(docs[d][off : off + n]).to(ids.dtype))
                served[d] += n
    assert np.array_equal(served, [len(d) for d in docs]), "drop_last=False serves every token once"


@pytest.mark.timeout(240)
def test_a_stream_row_is_one_copy_where_its_tokens_lie_together(stdlib_ds):
    """What makes ``stream`` cheap: consecutive pieces whose tokens are contiguous in the mapped
    shard are joined, so a row is a copy or two (more only where it crosses a record batch or a
    shard, or where a split document's pieces were re-cut head first), not one per document."""
    root, _ = stdlib_ds
    packing = Packing(8192, "stream")
    loader = ShardedLoader(root, seq_len=8192, batch_size=4, packing="stream", seed=1)
    rows = loader.plan.rows
    reader = BatchReader(SourceSpec(root))
    lay = BatchLayout(rows, packing, None, per_span=True)
    _, _, which, first, counts, dtype = reader.token_sources(lay.docs, keys=False)
    n = lay.copy_counts(counts, str)
    item = dtype.itemsize
    copies = joined_runs(lay.flat_start * item, which, (first + rows.span_start) * item, n * item)
    pieces, got = len(rows.span_pos), len(copies[0])
    assert pieces > 3 * rows.num_rows, "the rows hold several documents, or this shows nothing"
    # A split document's pieces re-cut head first cost a second copy in each of its two rows.
    assert got <= 2 * rows.num_rows, f"{got} copies for {rows.num_rows} rows of {pieces} pieces"
    # The joined copies write what one copy per piece writes.
    full = PackedReader(reader, packing).read(rows.slice(0, 4))
    lean = PackedReader(reader, packing, outputs="lean").read(rows.slice(0, 4))
    assert torch.equal(lean["input_ids"].to(torch.int64), full["input_ids"])


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(LAYOUTS), st.integers(256, 8192), st.integers(1, 8), st.integers(0, 3), st.integers(7, 400))
def test_stream_plan_cuts_each_group_in_storage_order(layout, seq, per_batch, epoch, shard):
    """Every epoch cuts the same stream (only the rows' order changes with the seed and epoch),
    so each row's documents are consecutive ids; equal batch counts on every DP rank."""
    lengths = stdlib_lengths()[:900]
    counts = np.full(lengths.size // shard, shard, np.int64)
    counts = np.append(counts, lengths.size - counts.sum()) if lengths.size % shard else counts
    dl = DataLayout.pure_dp(layout)
    planner = Planner(ArraySource(lengths, counts), Batching(batch_size=per_batch, packing=Packing(seq, "stream")))
    try:
        state = planner.start(epoch, "ds", dl)
    except ValueError as e:
        assert "too small" in str(e)
        return
    plans = [planner.rank_plan(state, d) for d in range(dl.dp_size)]
    assert len({p.batches_per_rank for p in plans}) == 1
    for p in plans:
        rows = p.rows
        per_row = np.split(rows.span_pos, rows.row_offsets[1:-1])
        assert all(np.array_equal(r, np.arange(r[0], r[0] + r.size)) for r in per_row if r.size)


def test_stream_rows_are_shuffled_across_epochs_and_seeds():
    lengths = stdlib_lengths()[:600]
    dl = DataLayout.pure_dp(Layout(1, 1))

    def first_docs(seed, epoch):
        planner = Planner(
            ArraySource(lengths, [300, 300]), Batching(batch_size=2, packing=Packing(1024, "stream"), seed=seed)
        )
        rows = planner.rank_plan(planner.start(epoch, "ds", dl), 0).rows
        return rows.span_pos[rows.row_offsets[:-1]]

    a, b, c = first_docs(0, 0), first_docs(0, 1), first_docs(1, 0)
    assert np.array_equal(a, first_docs(0, 0)), "same seed and epoch, same rows"
    assert not np.array_equal(a, b) and not np.array_equal(a, c)
    assert not np.all(np.diff(a) >= 0), "rows are not served in storage order"
    unshuffled = Planner(
        ArraySource(lengths, [300, 300]), Batching(batch_size=2, packing=Packing(1024, "stream"), shuffle=False)
    )
    rows = unshuffled.rank_plan(unshuffled.start(0, "ds", dl), 0).rows
    assert np.all(np.diff(rows.span_pos[rows.row_offsets[:-1]]) >= 0), "shuffle=False: the stream in order"


@pytest.mark.timeout(240)
def test_stream_resumes_exactly_with_workers(stdlib_ds):
    root, _ = stdlib_ds
    kw = dict(seq_len=1024, batch_size=2, packing="stream", seed=3, packed_outputs="lean")
    whole = [b["input_ids"] for b in ShardedLoader(root, num_workers=0, **kw)]
    ld = ShardedLoader(root, num_workers=2, **kw)
    it = iter(ld)
    for _ in range(9):
        next(it)
    state = json.loads(json.dumps(ld.state_dict()))
    it.close()
    again = ShardedLoader(root, num_workers=0, **kw)
    again.load_state_dict(state)
    rest = [b["input_ids"] for b in again]
    assert len(rest) == len(whole) - 9 > 5
    assert all(torch.equal(a, b) for a, b in zip(rest, whole[9:]))


def test_cli_plan_accepts_stream(stdlib_ds, capsys):
    from shardtool.cli import main

    root, _ = stdlib_ds
    assert main(["plan", root, "--seq-len", "2048", "--packing", "stream", "--batch-size", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # The plan a user reads before training is the loader's: the same stream rows, batch for batch.
    ld = ShardedLoader(root, seq_len=2048, packing="stream", batch_size=4, rank=0, world_size=1, metrics=False)
    assert out["batches_per_rank"] == len(ld) > 0


@pytest.mark.parametrize("layout", [Layout(1, 1), Layout(1, 3), Layout(1, 8)])
def test_one_groups_stream_has_no_batches_of_padding(layout):
    """One data group's stream rows are counted exactly from its lengths: drop_last=False gives
    the fewest batches that hold them (it gave 6 spare batches of padding rows in 1,477 on 200k
    documents at 8,192, from the bound for the worst order), and still serves every token."""
    lengths = np.concatenate([stdlib_lengths(), doc_lengths()[:3000]])
    dl = DataLayout.pure_dp(layout)
    per_batch, seq = 4, 2048
    planner = Planner(
        ArraySource(lengths, [lengths.size // 2, lengths.size - lengths.size // 2]),
        Batching(batch_size=per_batch, packing=Packing(seq, "stream", eos_id=0), drop_last=False),
    )
    state = planner.start(0, "ds", dl)
    plans = [planner.rank_plan(state, d) for d in range(dl.dp_size)]
    rows = sum(p.rows.num_rows for p in plans)
    assert rows == -(-int((lengths + 1).sum()) // seq)
    slots = dl.dp_size * per_batch
    assert plans[0].batches_per_rank == -(-rows // slots), "the fewest batches that hold every row"
    assert sum(int(p.rows.span_len.sum()) for p in plans) == int((lengths + 1).sum())
