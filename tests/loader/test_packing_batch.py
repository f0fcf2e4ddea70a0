"""Packed batches (shardtool.loader.packed): tensors consistent with the spans, no attention across documents."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.data_gen import packed_rows_dataset
from helpers.runcli import shardtool_cli
from helpers.s3server import s3_server  # noqa: F401  (fixture)
from shardtool.format import FormatError
from shardtool.loader.packed import IGNORE_INDEX, PackedReader, block_causal_mask, packed_batch
from shardtool.loader.reader import BatchReader
from shardtool.loader.source import SourceSpec
from shardtool.pack.synthetic import tokens_of as stored_tokens
from shardtool.pack.synthetic import write_synthetic
from shardtool.plan.packing import Packing, Rows, pack_rows

VOCAB = 50


def doc_tokens(doc: int, n: int) -> np.ndarray:
    return ((np.arange(n) * 3 + doc * 11) % (VOCAB - 2) + 2).astype(np.int32)  # 0 and 1 stay for pad and eos


def tokens_for(lengths: np.ndarray, ids_base: int = 0):
    return lambda ids: [doc_tokens(int(g), int(lengths[int(g) - ids_base])) for g in ids]


@st.composite
def packed_cases(draw):
    seq = draw(st.integers(2, 40))
    lengths = np.asarray(draw(st.lists(st.integers(0, 2 * seq + 3), min_size=1, max_size=40)), dtype=np.int64)
    eos = draw(st.sampled_from([None, 1]))
    maxd = draw(st.sampled_from([None, 2, 5]))
    policy = draw(st.sampled_from(["concat", "best-fit", "no-split"]))
    packing = Packing(seq, policy, eos_id=eos, max_docs_per_row=maxd)
    rows = pack_rows(lengths, packing)
    chosen = draw(st.lists(st.integers(0, max(rows.num_rows - 1, 0)), max_size=4)) if rows.num_rows else []
    extra = draw(st.integers(0, 2))
    return lengths, packing, rows.with_ids(np.arange(len(lengths)) + 1000).take(np.asarray(chosen, np.int64)), extra


def expected_rows(lengths, packing: Packing, batch: Rows, b: int):
    """The batch spelled out token by token: ids, labels, positions, segment starts, keys, and
    each segment's offset in its document (-1: a row of padding)."""
    seq, pad = packing.seq_len, 0
    ids, labels, positions, starts, keys, offsets = [], [], [], [], [], []
    for r in range(b):
        row_ids, row_lab, row_pos, row_keys = [], [], [], []
        lo, hi = (batch.row_offsets[r], batch.row_offsets[r + 1]) if r < batch.num_rows else (0, 0)
        for k in range(lo, hi):
            g, s, n = int(batch.span_pos[k]), int(batch.span_start[k]), int(batch.span_len[k])
            doc = list(doc_tokens(g, int(lengths[g - 1000]))) + ([packing.eos_id] if packing.eos_id is not None else [])
            piece = doc[s : s + n]
            starts.append(r * seq + len(row_ids))
            offsets.append(s)
            row_ids += piece
            row_lab += piece[1:] + [IGNORE_INDEX]
            row_pos += list(range(n))
            row_keys.append(g)
        if not row_ids:
            starts.append(r * seq)
            offsets.append(-1)
        fill = seq - len(row_ids)
        last = row_pos[-1] + 1 if row_pos else 0
        ids.append(row_ids + [pad] * fill)
        labels.append(row_lab + [IGNORE_INDEX] * fill)
        positions.append(row_pos + list(range(last, last + fill)))
        keys.append(row_keys)
    return ids, labels, positions, starts, keys, offsets


@settings(max_examples=200, deadline=None)
@given(packed_cases())
def test_batch_tensors_match_the_spans(case):
    lengths, packing, batch, extra = case
    b = batch.num_rows + extra
    out = packed_batch(batch, tokens_for(lengths, 1000), packing, rows_per_batch=b)
    ids, labels, positions, starts, keys, offsets = expected_rows(lengths, packing, batch, b)
    seq = packing.seq_len
    assert out["input_ids"].dtype == torch.int64 and out["input_ids"].shape == (b, seq)
    assert out["input_ids"].tolist() == ids
    assert out["labels"].tolist() == labels
    assert out["position_ids"].tolist() == positions
    cu = out["cu_seqlens"]
    assert cu.dtype == torch.int32 and cu.shape == (b * packing.max_docs_per_row + 1,)
    assert cu.tolist() == starts + [b * seq] * (len(cu) - len(starts))
    assert out["max_seqlen"] == max(np.diff(starts + [b * seq]).tolist(), default=0)
    assert out["__key__"] == keys
    doc_offsets = out["doc_offsets"]
    assert doc_offsets.dtype == torch.int64 and doc_offsets.shape == (b * packing.max_docs_per_row,)
    assert doc_offsets.tolist() == offsets + [-1] * (len(doc_offsets) - len(offsets))
    assert out["lengths"].tolist() == [
        int(batch.span_len[batch.row_offsets[r] : batch.row_offsets[r + 1]].sum()) if r < batch.num_rows else 0
        for r in range(b)
    ]


class Tiny(torch.nn.Module):
    """Two pre-norm transformer blocks with learned absolute positions (so positions matter)."""

    def __init__(self, vocab: int = VOCAB, d: int = 16, heads: int = 2, max_pos: int = 64):
        super().__init__()
        self.heads = heads
        self.tok, self.pos = torch.nn.Embedding(vocab, d), torch.nn.Embedding(max_pos, d)
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleDict(
                {
                    "n1": torch.nn.LayerNorm(d),
                    "qkv": torch.nn.Linear(d, 3 * d),
                    "out": torch.nn.Linear(d, d),
                    "n2": torch.nn.LayerNorm(d),
                    "mlp": torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d)),
                }
            )
            for _ in range(2)
        )
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(pos)
        b, s, d = x.shape
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["n1"](x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + blk["out"](att.transpose(1, 2).reshape(b, s, d))
            x = x + blk["mlp"](blk["n2"](x))
        return self.head(x)


def causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()[None, None]


@pytest.mark.parametrize("policy, eos", [("best-fit", None), ("best-fit", 1), ("concat", 1), ("no-split", None)])
def test_no_cross_contamination(policy, eos):
    torch.manual_seed(0)
    model = Tiny().double().eval()
    seq = 48
    lengths = np.random.default_rng(1).integers(1, 40, 30)
    packing = Packing(seq, policy, eos_id=eos)
    rows = pack_rows(lengths, packing)
    batch = packed_batch(rows, tokens_for(lengths), packing)
    with torch.no_grad():
        logits = model(batch["input_ids"], batch["position_ids"], block_causal_mask(batch))
        plain = model(batch["input_ids"], batch["position_ids"], causal(seq))
    flat = logits.reshape(-1, VOCAB)
    cu = batch["cu_seqlens"].tolist()
    starts = rows.row_offsets  # first span of each row starts at column 0
    before = np.cumsum(rows.span_len) - rows.span_len
    row_of = np.repeat(np.arange(rows.num_rows), np.diff(starts))
    checked = contaminated = 0
    for k in range(len(rows.span_pos)):
        g, s, n = int(rows.span_pos[k]), int(rows.span_start[k]), int(rows.span_len[k])
        at = int(row_of[k] * seq + before[k] - before[starts[row_of[k]]])
        assert at in cu
        doc = torch.as_tensor(
            np.concatenate([doc_tokens(g, int(lengths[g])), [eos] if eos is not None else []])[s : s + n],
            dtype=torch.int64,
        )[None]
        with torch.no_grad():
            alone = model(doc, torch.arange(n)[None], causal(n))[0]
        torch.testing.assert_close(flat[at : at + n], alone, rtol=1e-9, atol=1e-9)
        checked += s == 0 and n == len(doc[0])
        contaminated += at % seq != 0 and not torch.allclose(plain.reshape(-1, VOCAB)[at : at + n], alone)
    assert checked >= 20
    assert contaminated > 0  # the check can tell: a plain causal mask leaks across documents


def test_cu_seqlens_drive_varlen_attention_like_the_mask():
    """Attention per cu_seqlens segment (what flash-attn varlen computes) equals the masked SDPA."""
    torch.manual_seed(0)
    lengths = np.random.default_rng(2).integers(1, 30, 25)
    packing = Packing(32, "best-fit", eos_id=1)
    batch = packed_batch(pack_rows(lengths, packing), tokens_for(lengths), packing)
    b, seq = batch["input_ids"].shape
    q, k, v = torch.randn(3, 1, 2, b * seq, 8, dtype=torch.float64)
    cu = batch["cu_seqlens"].tolist()
    varlen = torch.zeros_like(q)
    for a, z in zip(cu[:-1], cu[1:]):
        if z > a:
            varlen[..., a:z, :] = F.scaled_dot_product_attention(
                q[..., a:z, :], k[..., a:z, :], v[..., a:z, :], is_causal=True
            )
    assert max(z - a for a, z in zip(cu[:-1], cu[1:])) == batch["max_seqlen"]
    per_row = lambda t: t.view(2, b, seq, 8).transpose(0, 1)  # [B, heads, S, dim]
    masked = F.scaled_dot_product_attention(
        per_row(q[0]), per_row(k[0]), per_row(v[0]), attn_mask=block_causal_mask(batch)
    )
    torch.testing.assert_close(per_row(varlen[0]), masked)


@pytest.mark.parametrize("fmt, dtype", [("tar", "i4"), ("arrow", "i2"), ("tar", "u2")])
def test_reader_fast_path_equals_generic_path(tmp_path, fmt, dtype):
    ds, lengths, packing, rows = packed_rows_dataset(str(tmp_path / "ds"), fmt, dtype)  # window order != id order
    reader = BatchReader(SourceSpec(ds.root), pad_id=7)
    fast = PackedReader(reader, packing, name="tokens", pad_id=7, rows_per_batch=None)
    want_tokens = lambda ids: [stored_tokens(int(g), int(lengths[g]), 1000, dtype) for g in ids]
    for sel in (np.arange(8), np.arange(rows.num_rows - 5, rows.num_rows), np.array([3, 1, 4, 1])):
        batch = rows.take(sel)
        got = fast.read(batch)
        want = packed_batch(
            batch, want_tokens, packing, keys_of=lambda ids: [ds.keys[g] for g in ids], name="tokens", pad_id=7
        )
        assert got.keys() == want.keys()
        for key in want:
            if isinstance(want[key], torch.Tensor):
                assert torch.equal(got[key], want[key]), key
            else:
                assert got[key] == want[key], key
    reader.close()


def test_remote_shards_decode_to_the_same_batch(tmp_path, s3_server):  # noqa: F811
    lengths = np.random.default_rng(4).integers(1, 40, 60)
    ds = write_synthetic(str(tmp_path / "ds"), lengths=lengths, shard_sizes=[25, 35], vocab=1000)
    url = s3_server.upload(ds.root, "packing/ds")
    packing = Packing(32, "concat", eos_id=999)
    rows = pack_rows(lengths, packing).take(np.arange(4))
    local = BatchReader(SourceSpec(ds.root))
    remote = BatchReader(SourceSpec(url, storage_options=s3_server.storage_options))
    assert remote.token_sources(np.arange(3)) is None  # no maps: decoded sample by sample
    want, got = PackedReader(local, packing).read(rows), PackedReader(remote, packing).read(rows)
    for key in want:
        assert torch.equal(got[key], want[key]) if isinstance(want[key], torch.Tensor) else got[key] == want[key], key
    local.close()
    remote.close()


def test_a_dataset_without_token_arrays_is_refused(tmp_path):
    ds = write_synthetic(str(tmp_path / "ds"), 10, kind="bytes", sample_bytes=20, samples_per_shard=10)
    reader = BatchReader(SourceSpec(ds.root))
    with pytest.raises(FormatError, match="length field to be a 1-D integer token array.*'bin'"):
        PackedReader(reader, Packing(64)).read(pack_rows(ds.lengths, Packing(64)))
    reader.close()


def test_packing_a_dataset_of_no_token_field_is_refused_when_the_loader_is_made(tmp_path):
    """Real files packed --per-file (length: payload bytes, no field) and a raw bytes field: a
    packed loader refused at the first batch, after len() and the trainer's set-up; shardtool plan
    planned rows it could never read (13% of the tokens a remainder, by a weight of bytes)."""
    import shardtool
    from shardtool.loader import ShardedLoader
    from shardtool.plan.mixture import Mixture

    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("a.txt", "b", "c.md"):
        (tree / name).write_bytes(open(__file__, "rb").read()[: 300 + len(name)])
    shardtool.pack([str(tree)], str(tmp_path / "files"), per_file=True)
    raw = write_synthetic(str(tmp_path / "raw"), 10, kind="bytes", sample_bytes=20, samples_per_shard=10).root
    for url, why in ((str(tmp_path / "files"), "byte size, not a field's"), (raw, "field 'bin', which holds raw")):
        with pytest.raises(ValueError, match=f"{url}: packed rows .*{why}.*--length FIELD"):
            ShardedLoader(url, seq_len=64, batch_size=2, rank=0, world_size=1, num_workers=0)
        planned = shardtool_cli("plan", url, "--seq-len", "64", "--batch-size", "2")
        assert planned.returncode == 1 and why in planned.stderr, planned.stderr
        ShardedLoader(url, batch_size=2, rank=0, world_size=1, num_workers=0).close()  # unpacked: fine
    mixture = Mixture({"files": (str(tmp_path / "files"), 1.0)})
    with pytest.raises(ValueError, match="mixture source 'files' .*byte size, not a field's"):
        ShardedLoader(mixture, steps=2, seq_len=64, batch_size=2, rank=0, world_size=1, num_workers=0)


def test_packing_by_an_integer_length_column_names_the_token_field_to_pack_by(tmp_path):
    """A Parquet of token ids and their count, packed ``--length n``: the length is the column's
    value, so the rows cannot be cut; the error says so and names the one array field to use."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import shardtool
    from shardtool.loader import ShardedLoader

    ids = [list(range(n)) for n in (5, 40, 17)]
    pq.write_table(pa.table({"ids": ids, "n": [len(x) for x in ids]}), str(tmp_path / "d.parquet"))
    shardtool.pack([str(tmp_path / "d.parquet")], str(tmp_path / "ds"), length="n")
    with pytest.raises(ValueError, match=r"the value of its field 'n', which holds int .*pack --length ids,"):
        ShardedLoader(str(tmp_path / "ds"), seq_len=32, batch_size=2, rank=0, world_size=1, num_workers=0)


def test_data_that_disagrees_with_the_lengths_is_named(tmp_path):
    packing = Packing(16, "concat")
    rows = pack_rows(np.array([5, 9]), packing).with_ids(np.array([40, 41]))
    with pytest.raises(FormatError, match="sample 41 has 3 tokens.*up to 9"):
        packed_batch(rows, lambda ids: [np.arange(5), np.arange(3)], packing)
    ds = write_synthetic(str(tmp_path / "ds"), lengths=np.array([5, 3]), shard_sizes=[2])
    reader = BatchReader(SourceSpec(ds.root))
    with pytest.raises(FormatError, match=r"shard .* sample #1 has 3 tokens"):
        PackedReader(reader, packing).read(pack_rows(np.array([5, 9]), packing))
    reader.close()


def test_bad_batches_are_refused():
    packing = Packing(8, "best-fit", max_docs_per_row=2)
    rows = pack_rows(np.array([1, 1, 1]), Packing(8, "best-fit", max_docs_per_row=3))
    with pytest.raises(ValueError, match="3 pieces, more than max_docs_per_row 2"):
        packed_batch(rows, tokens_for(np.array([1, 1, 1])), packing)
    with pytest.raises(ValueError, match="seq_len 8, the batch is for 4"):
        packed_batch(rows, tokens_for(np.array([1, 1, 1])), Packing(4))
    with pytest.raises(ValueError, match="do not fit a batch of 0 rows"):
        packed_batch(rows, tokens_for(np.array([1, 1, 1])), Packing(8), rows_per_batch=0)


def test_block_causal_mask_small_example():
    packing = Packing(4, "concat", max_docs_per_row=3)
    batch = packed_batch(pack_rows(np.array([2, 3, 1]), packing), tokens_for(np.array([2, 3, 1])), packing)
    # rows: [d0 d0 d1 d1] [d1 d2 pad pad]; the padding belongs to d2's segment.
    assert batch["cu_seqlens"].tolist() == [0, 2, 4, 5, 8, 8, 8]
    m = block_causal_mask(batch).int()[:, 0].tolist()
    assert m[0] == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    assert m[1] == [[1, 0, 0, 0], [0, 1, 0, 0], [0, 1, 1, 0], [0, 1, 1, 1]]
    assert batch["position_ids"].tolist() == [[0, 1, 0, 1], [0, 0, 1, 2]]
    assert batch["labels"][1].tolist() == [IGNORE_INDEX] * 4
