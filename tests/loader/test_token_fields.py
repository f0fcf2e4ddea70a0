"""Per-token fields through packing (issue 37, item 1): a loss mask, role ids and stored labels are
cut, placed and padded with the tokens, and the labels honour them. Real documents: stdlib source
files as byte ids, whose comment lines are the trained (masked-in) tokens."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch

from helpers.realtext import stdlib_files
from helpers.s3server import s3_server  # noqa: F401  (fixture)
from shardtool.format import FormatError
from shardtool.loader import ShardedLoader
from shardtool.loader.packed import IGNORE_INDEX, lean_to_full
from shardtool.pack import pack
from shardtool.plan.mixture import Mixture

PAD, EOS = 0, 1  # byte ids are shifted by 2: no byte of a file is either


def stdlib_docs(limit: int = 90, lo: int = 300, hi: int = 24000) -> list[dict]:
    """Stdlib files as samples: ``tokens`` (bytes + 2), ``role`` per byte (0 code, 1 a comment
    line, 2 a blank line), ``loss_mask`` (1 on comment lines), ``path`` (text, not per-token)."""
    out = []
    for path in stdlib_files():
        if not lo <= os.path.getsize(path) <= hi:
            continue
        data = open(path, "rb").read()
        role = np.zeros(len(data), np.int16)
        at = 0
        for line in data.splitlines(keepends=True):
            s = line.strip()
            role[at : at + len(line)] = 2 if not s else 1 if s.startswith(b"#") else 0
            at += len(line)
        out.append(
            {
                "__key__": f"f{len(out):04d}",
                "tokens": np.frombuffer(data, np.uint8).astype(np.int32) + 2,
                "loss_mask": (role == 1).astype(np.uint8),
                "role": role,
                "path": os.path.relpath(path, os.path.dirname(os.__file__)),
            }
        )
        if len(out) == limit:
            break
    assert len(out) == limit, "too few stdlib files here"
    return out


@pytest.fixture(scope="module")
def docs():
    return stdlib_docs()


@pytest.fixture(scope="module")
def datasets(docs, tmp_path_factory):
    root = tmp_path_factory.mktemp("tokfields")
    out = {}
    for fmt in ("arrow", "tar"):
        out[fmt] = str(root / fmt)
        pack(docs, out[fmt], length="tokens", format=fmt, key="__key__", samples_per_shard=25)
    return out


def loader(url, **kw):
    kw.setdefault("num_workers", 0)
    kw.setdefault("token_fields", ["loss_mask", "role"])
    return ShardedLoader(url, **kw)


def check_packed(batch: dict, docs: dict, seq: int, eos: int | None) -> list[tuple[str, int, int]]:
    """Every piece of a full packed batch against its document, token by token: tokens, each
    per-token field (the eos takes the document's last value; padding 0) and the labels (the next
    token of the piece where its loss mask is set, else -100). Returns the pieces (key, offset, n)."""
    ids, labels = batch["input_ids"].numpy(), batch["labels"].numpy()
    b = ids.shape[0]
    cu, offsets, lengths = batch["cu_seqlens"].numpy(), batch["doc_offsets"].numpy(), batch["lengths"].numpy()
    keys = [k for row in batch["__key__"] for k in row]
    fields = ["loss_mask", "role"]
    pieces, k = [], 0
    for i in range(len(offsets)):
        start = int(cu[i])
        if start >= b * seq:
            break
        r = start // seq
        end = min(int(cu[i + 1]), r * seq + int(lengths[r]))
        if offsets[i] < 0:  # a row of padding
            assert lengths[r] == 0
            continue
        doc, off, n = docs[keys[k]], int(offsets[i]), end - start
        k += 1
        pieces.append((keys[k - 1], off, n))
        extra = [] if eos is None else [eos]
        want = np.concatenate([doc["tokens"], extra])[off : off + n]
        assert np.array_equal(ids.reshape(-1)[start:end], want), (keys[k - 1], off)
        mask = np.concatenate([doc["loss_mask"], doc["loss_mask"][-1:] if extra else []])[off : off + n]
        for f in fields:
            ext = np.concatenate([doc[f], doc[f][-1:] if extra else []])[off : off + n]
            assert np.array_equal(batch[f].numpy().reshape(-1)[start:end], ext), (f, keys[k - 1], off)
        want_labels = np.where(mask[1:] == 1, want[1:], IGNORE_INDEX)
        assert np.array_equal(labels.reshape(-1)[start : end - 1], want_labels), (keys[k - 1], off)
        assert labels.reshape(-1)[end - 1] == IGNORE_INDEX
    assert k == len(keys)
    for r in range(b):  # padding: pad id, fields 0, no targets
        tail = slice(int(lengths[r]), seq)
        assert (ids[r, tail] == PAD).all() and (labels[r, tail] == IGNORE_INDEX).all()
        for f in fields:
            assert (batch[f].numpy()[r, tail] == 0).all()
    return pieces


@pytest.mark.parametrize(
    "fmt, seq, policy, eos, workers, world",
    [
        ("arrow", 256, "best-fit", EOS, 0, 1),
        ("tar", 2048, "best-fit", EOS, 2, 3),
        ("arrow", 1024, "no-split", None, 0, 3),
        ("arrow", 512, "stream", None, 2, 1),
        ("tar", 8192, "concat", EOS, 0, 2),
    ],
)
def test_fields_follow_their_tokens_on_every_rank(docs, datasets, fmt, seq, policy, eos, workers, world):
    by_key = {d["__key__"]: d for d in docs}
    seen = []
    for rank in range(world):
        ld = loader(
            datasets[fmt], seq_len=seq, batch_size=3, packing=policy, eos_id=eos, num_workers=workers,
            rank=rank, world_size=world, drop_last=False,
        )  # fmt: skip
        assert ld.token_fields == ("loss_mask", "role")
        steps = 0
        for batch in ld:
            assert batch["loss_mask"].shape == batch["input_ids"].shape
            assert batch["loss_mask"].dtype == torch.uint8 and batch["role"].dtype == torch.int16
            seen += check_packed(batch, by_key, seq, eos)
            steps += 1
        assert steps == len(ld)
        ld.close()
    # Every token of every document, and so its mask and role, was served once in the pass
    # (no-split leaves out a document longer than a row).
    covered = {d["__key__"]: np.zeros(len(d["tokens"]) + (eos is not None), np.int64) for d in docs}
    for key, off, n in seen:
        covered[key][off : off + n] += 1
    if policy == "no-split":
        assert all((c == (len(c) <= seq)).all() for c in covered.values())
    else:
        assert all((c == 1).all() for c in covered.values())


@pytest.mark.parametrize("fmt, workers", [("arrow", 0), ("tar", 2)])
def test_lean_batches_carry_the_fields_and_derive_the_same_labels(datasets, fmt, workers):
    kw = dict(seq_len=1024, batch_size=4, eos_id=EOS, num_workers=workers, rank=1, world_size=2)
    full, lean = loader(datasets[fmt], **kw), loader(datasets[fmt], packed_outputs="lean", **kw)
    n = 0
    for a, b in zip(full, lean):
        assert "labels" not in b and b["loss_mask"].dtype == torch.uint8
        derived = lean_to_full(b)
        for key in ("input_ids", "labels", "position_ids", "loss_mask", "role", "cu_seqlens"):
            assert torch.equal(derived[key], a[key]), key
        n += 1
    assert n == len(full) > 10
    full.close()
    lean.close()


def test_stored_labels_are_the_targets(docs, tmp_path):
    """Hugging Face's convention: stored labels, unshifted, -100 where untrained. Packed, they give
    the same labels as the loss mask they were made from; the eos is the target after a trained end."""
    rows = [{**d, "labels": np.where(d["loss_mask"] == 1, d["tokens"], IGNORE_INDEX)} for d in docs[:40]]
    pack(rows, str(tmp_path / "ds"), length="tokens", key="__key__")
    kw = dict(seq_len=512, batch_size=2, eos_id=EOS, rank=0, world_size=1)
    with_labels = loader(str(tmp_path / "ds"), token_fields=["labels"], **kw)
    with_mask = loader(str(tmp_path / "ds"), token_fields=["loss_mask"], **kw)
    lean = loader(str(tmp_path / "ds"), token_fields=["labels"], packed_outputs="lean", **kw)
    ends = 0
    for a, b, c in zip(with_labels, with_mask, lean):
        assert torch.equal(a["labels"], b["labels"])
        assert torch.equal(lean_to_full(c)["labels"], a["labels"])
        # The eos after a document whose last byte is in a comment line is a target.
        flat_ids, flat_lab = a["input_ids"].reshape(-1), a["labels"].reshape(-1)
        at = torch.nonzero(flat_ids[1:] == EOS).reshape(-1)
        ends += int((flat_lab[at] == EOS).sum())
    assert ends >= 0  # counted below against the data
    trained_ends = sum(int(d["loss_mask"][-1]) for d in docs[:40])
    assert ends == trained_ends
    for ld in (with_labels, with_mask, lean):
        ld.close()


def test_a_mixture_carries_the_fields_of_its_sources(docs, tmp_path):
    by_key = {}
    for name, part in (("a", docs[:45]), ("b", docs[45:])):
        rows = [{**d, "__key__": f"{name}{d['__key__']}"} for d in part]
        by_key.update({r["__key__"]: r for r in rows})
        pack(rows, str(tmp_path / name), length="tokens", key="__key__")
    mix = Mixture({"a": (str(tmp_path / "a"), 1.0), "b": (str(tmp_path / "b"), 2.0)})
    ld = loader(mix, seq_len=512, batch_size=4, eos_id=EOS, steps=30, rank=0, world_size=1)
    sources = set()
    for batch in ld:
        check_packed(batch, by_key, 512, EOS)
        sources |= set(batch["__source__"])
    assert sources == {"a", "b"}
    ld.close()
    pack([{k: v for k, v in d.items() if k != "role"} for d in docs[:10]], str(tmp_path / "c"), length="tokens")
    other = Mixture({"a": (str(tmp_path / "a"), 1.0), "c": (str(tmp_path / "c"), 1.0)})
    with pytest.raises(ValueError, match="different per-token fields.*'role'"):
        ShardedLoader(other, seq_len=512, batch_size=4, steps=5, num_workers=0, rank=0, world_size=1)


def test_remote_shards_carry_the_fields(datasets, s3_server):  # noqa: F811
    url = s3_server.upload(datasets["tar"], "tokfields/tar")
    kw = dict(seq_len=1024, batch_size=2, eos_id=EOS, rank=0, world_size=1)
    local = loader(datasets["tar"], **kw)
    remote = loader(url, storage_options=s3_server.storage_options, **kw)
    for i, (a, b) in enumerate(zip(local, remote)):
        for key in ("input_ids", "labels", "loss_mask", "role"):
            assert torch.equal(a[key], b[key]), key
        if i == 5:
            break
    local.close()
    remote.close()


def test_a_resumed_loader_gives_the_same_fields(datasets):
    kw = dict(seq_len=256, batch_size=2, eos_id=EOS, num_workers=2, rank=0, world_size=1)
    ld = loader(datasets["arrow"], **kw)
    whole = [b["loss_mask"].clone() for b in ld]
    ld.close()
    first = loader(datasets["arrow"], **kw)
    it = iter(first)
    for _ in range(7):
        next(it)
    state = first.state_dict()
    first.close()
    again = loader(datasets["arrow"], **kw)
    again.load_state_dict(state)
    rest = [b["loss_mask"] for b in again]
    assert len(rest) == len(whole) - 7
    assert all(torch.equal(x, y) for x, y in zip(rest, whole[7:]))
    again.close()


def test_fields_that_are_not_per_token_are_named(datasets, docs, tmp_path):
    url = datasets["arrow"]
    kw = dict(seq_len=256, batch_size=2, rank=0, world_size=1, num_workers=0)
    with pytest.warns(UserWarning, match="'path' is not per-token and left out") as caught:
        ld = ShardedLoader(url, **kw)
    assert caught[0].filename == __file__  # the line that built the loader
    assert ld.token_fields == ("loss_mask", "role")
    ld.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ShardedLoader(url, token_fields=["loss_mask"], **kw).close()
    with pytest.raises(ValueError, match="'path' holds text values, not an array aligned"):
        ShardedLoader(url, token_fields=["path"], **kw)
    with pytest.raises(ValueError, match="'nope' is not a field of the dataset"):
        ShardedLoader(url, token_fields=["nope"], **kw)
    with pytest.raises(ValueError, match="token_fields chooses the per-token fields of packed rows"):
        ShardedLoader(url, token_fields=["loss_mask"], batch_size=2, rank=0, world_size=1)
    # An array that is not aligned (a fixed-size vector per document) is refused before training.
    rows = [{**d, "emb": np.arange(8, dtype=np.float32)} for d in docs[:5]]
    pack(rows, str(tmp_path / "emb"), length="tokens", key="__key__")
    with pytest.raises(ValueError, match=r"emb.*field 'emb' is not aligned with the tokens: sample 'f0000' has 8"):
        ShardedLoader(str(tmp_path / "emb"), token_fields=["emb", "loss_mask"], **kw)
    # A field with a name packing builds is refused, not overwritten.
    rows = [{"tokens": d["tokens"], "position_ids": np.arange(len(d["tokens"]))} for d in docs[:5]]
    pack(rows, str(tmp_path / "pos"), length="tokens")
    with pytest.raises(ValueError, match="'position_ids' has the name of a key packing builds"):
        ShardedLoader(str(tmp_path / "pos"), **kw)


def test_a_later_misaligned_sample_is_named_when_read(docs, tmp_path):
    rows = [dict(d) for d in docs[:12]]
    rows[9]["loss_mask"] = rows[9]["loss_mask"][:-3]
    pack(rows, str(tmp_path / "ds"), length="tokens", key="__key__")
    ld = loader(str(tmp_path / "ds"), seq_len=256, batch_size=4, rank=0, world_size=1, shuffle=False)
    with pytest.raises(FormatError, match=r"sample #9: field 'loss_mask' has \d+ values where the tokens are"):
        for _ in ld:
            pass
    ld.close()


def test_truncating_at_pack_time_cuts_the_fields_with_the_tokens(docs, tmp_path):
    pack(docs[:20], str(tmp_path / "ds"), length="tokens", key="__key__", max_length=200, max_length_policy="truncate")
    ld = loader(str(tmp_path / "ds"), seq_len=256, batch_size=2, eos_id=EOS, rank=0, world_size=1)
    cut = {d["__key__"]: {f: d[f][:200] for f in ("tokens", "loss_mask", "role")} for d in docs[:20]}
    for batch in ld:
        check_packed(batch, cut, 256, EOS)
    ld.close()


@pytest.mark.parametrize("exact", [False, True])
def test_the_fields_do_not_depend_on_the_workers(datasets, exact):
    kw = dict(seq_len=512, batch_size=3, eos_id=EOS, rank=1, world_size=3, exact=exact, shuffle=not exact)
    runs = []
    for workers in (0, 2):
        ld = loader(datasets["tar"], num_workers=workers, **kw)
        runs.append(list(ld))
        ld.close()
    alone, pooled = runs
    assert len(alone) == len(pooled) > 5
    for a, b in zip(alone, pooled):
        assert a.keys() == b.keys() and ("valid" in a) == exact
        for key in ("input_ids", "labels", "loss_mask", "role", "cu_seqlens"):
            assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("fmt, workers", [("arrow", 0), ("tar", 2)])
def test_a_warmups_cut_rows_carry_the_fields_and_their_labels(docs, datasets, fmt, workers):
    """A sequence-length warmup cuts planned rows of 1,024 into rows of 256: the fields go with
    their tokens through the cut, and a piece's last token before a cut has no target."""
    by_key = {d["__key__"]: d for d in docs}
    ld = loader(
        datasets[fmt], seq_len={0: 256, 6: 1024}, batch_size=4, eos_id=EOS, num_workers=workers, drop_last=False
    )
    seen, steps = [], 0
    for t, batch in enumerate(ld):
        seq = batch["input_ids"].shape[1]
        assert seq == (256 if t < 6 else 1024)
        seen += check_packed(batch, by_key, seq, EOS)
        steps += 1
    assert steps > 6
    covered = {d["__key__"]: np.zeros(len(d["tokens"]) + 1, np.int64) for d in docs}
    for key, off, n in seen:
        covered[key][off : off + n] += 1
    assert all((c == 1).all() for c in covered.values())  # every token once (best-fit drops none)
