"""Tokenization at pack time, with tokenizers trained here on the test corpus (nothing downloaded)."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pytest
import tokenizers  # noqa: E402, F401  a declared test dependency

import shardtool
from helpers.runcli import shardtool_cli
from shardtool.format.errors import BadSampleError, ShardtoolError


def _corpus(n: int = 400, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    words = ["".join(chr(97 + c) for c in rng.integers(0, 26, rng.integers(2, 9))) for _ in range(800)]
    words += ["naïve", "über", "日本語", "😀"]
    return [{"id": f"doc{i}", "text": " ".join(rng.choice(words, rng.integers(1, 60))), "lang": "xx"} for i in range(n)]


def _train(texts: list[str], vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    if vocab > 1 << 16:
        # A vocabulary past 65,536 ids without a corpus that large: a word-level model over made-up
        # words, which is still a real tokenizer (ids from tokenizer.encode).
        words = {f"w{i}": i for i in range(vocab - 1)}
        words["[UNK]"] = vocab - 1
        tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    else:
        tok = Tokenizer(models.BPE(unk_token="[UNK]"))
        tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["[UNK]", "[EOS]"]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rows = _corpus()
    d = tmp_path_factory.mktemp("tok")
    with open(d / "corpus.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    tok = _train([r["text"] for r in rows], 600)
    tok.save(str(d / "tokenizer.json"))
    return d, rows, tok


@pytest.mark.parametrize("fmt", ["tar", "arrow"])
@pytest.mark.timeout(120)
def test_token_ids_are_the_tokenizers_and_lengths_their_counts(corpus, tmp_path, fmt):
    d, rows, tok = corpus
    eos = tok.token_to_id("[EOS]")
    r = shardtool.pack(
        str(d / "corpus.jsonl"),
        str(tmp_path / "ds"),
        format=fmt,
        key="id",
        text_field="text",
        tokenizer=str(d / "tokenizer.json"),
        eos_id=eos,
        workers=2,
        samples_per_shard=90,
    )
    ds = shardtool.open_dataset(str(tmp_path / "ds"))
    assert r.samples == len(rows) and ds.num_shards > 2
    assert ds.manifest.field_names == ["tokens", "lang"]  # the text is dropped, the key is the key
    assert ds.manifest.field("tokens").dtype == "u2" and ds.manifest.length["field"] == "tokens"
    want = [tok.encode(row["text"]).ids + [eos] for row in rows]
    got = list(ds)
    assert [s["__key__"] for s in got] == [row["id"] for row in rows]
    for w, s in zip(want, got):
        assert s["tokens"].dtype == np.uint16 and s["tokens"].tolist() == w
    assert ds.lengths.tolist() == [len(w) for w in want]


def test_keep_text_and_every_source_kind_and_tokenizer_object(corpus, tmp_path):
    d, rows, tok = corpus
    opts = dict(format="arrow", text_field="text", keep_text=True)
    ref = shardtool.pack(str(d / "corpus.jsonl"), str(tmp_path / "jsonl"), tokenizer=str(d), **opts)
    ds = shardtool.open_dataset(ref.out)
    assert ds.manifest.field_names == ["id", "tokens", "text", "lang"]
    first = ds.read(0, 0)
    assert first["text"] == rows[0]["text"] and first["tokens"].tolist() == tok.encode(rows[0]["text"]).ids
    for name, src in {"dicts": rows, "table": pa.Table.from_pylist(rows), "generator": iter(rows)}.items():
        shardtool.pack(src, str(tmp_path / name), tokenizer=tok, **opts)
        assert shardtool.open_dataset(str(tmp_path / name)).version == ds.version, name


def test_transformers_fast_tokenizer_object_is_used_through_its_backend(corpus, tmp_path):
    d, rows, tok = corpus
    import transformers

    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok)
    shardtool.pack(rows[:20], str(tmp_path / "ds"), text_field="text", tokenizer=fast)
    got = [s["tokens"].tolist() for s in shardtool.open_dataset(str(tmp_path / "ds"))]
    assert got == [fast(r["text"])["input_ids"] for r in rows[:20]]


def test_vocabulary_past_65536_ids_stores_uint32(tmp_path):
    tok = _train([], 70_000)
    rows = [{"text": "w1 w65535 w65536 w69998 nope"}, {"text": "w3"}]
    shardtool.pack(rows, str(tmp_path / "ds"), text_field="text", tokenizer=tok)
    ds = shardtool.open_dataset(str(tmp_path / "ds"))
    assert ds.manifest.field("tokens").dtype == "u4"
    assert [s["tokens"].tolist() for s in ds] == [[1, 65535, 65536, 69998, 69999], [3]]


def test_bad_text_rows_and_bad_options(corpus, tmp_path):
    d, rows, tok = corpus
    bad = [dict(r) for r in rows[:10]]
    bad[4]["text"] = 42
    with pytest.raises(BadSampleError, match=r"row 4\).*--text-field 'text' is a int"):
        shardtool.pack(bad, str(tmp_path / "a"), text_field="text", tokenizer=tok)
    r = shardtool.pack(bad, str(tmp_path / "b"), text_field="text", tokenizer=tok, skip_bad=True)
    assert r.samples == 9 and "row 4" in r.skipped[0]
    with pytest.raises(ShardtoolError, match="no such file"):
        shardtool.pack(rows, str(tmp_path / "c"), text_field="text", tokenizer=str(tmp_path / "missing.json"))
    with pytest.raises(ShardtoolError, match="go together"):
        shardtool.pack(rows, str(tmp_path / "c"), tokenizer=tok)
    with pytest.raises(ShardtoolError, match="not a field"):
        shardtool.pack(rows, str(tmp_path / "c"), text_field="body", tokenizer=tok)
    with pytest.raises(ShardtoolError, match="eos-id"):
        shardtool.pack(rows, str(tmp_path / "c"), text_field="text", tokenizer=tok, eos_id=10**6)
    with pytest.raises(ShardtoolError, match="token count"):
        shardtool.pack(rows, str(tmp_path / "c"), text_field="text", tokenizer=tok, length="lang")
    assert not os.path.exists(tmp_path / "c")


@pytest.mark.timeout(120)
def test_cli_tokenizes_a_jsonl_in_one_command(corpus, tmp_path):
    d, rows, tok = corpus
    out = tmp_path / "cli"
    proc = shardtool_cli(
        "pack",
        str(d / "corpus.jsonl"),
        "-o",
        str(out),
        "--text-field",
        "text",
        "--tokenizer",
        str(d / "tokenizer.json"),
        "--eos-id",
        "1",
        "--workers",
        "2",
        "--format",
        "arrow",
        "--json",
        timeout=100,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["samples"] == len(rows)
    ds = shardtool.open_dataset(str(out))
    assert ds.lengths.tolist() == [len(tok.encode(r["text"]).ids) + 1 for r in rows]


def test_a_tars_txt_members_are_tokenized(tmp_path):
    """WebDataset image-text tars hold captions as .txt members (raw UTF-8 bytes): real stdlib text."""
    from helpers.realtext import stdlib_files, train_tokenizer
    from helpers.webtars import write_tar

    texts = [open(p, encoding="utf-8").read() for p in stdlib_files(30)]
    tok = train_tokenizer(texts, 600)
    samples = [(f"s{i:03d}", {"txt": t.encode(), "cls": str(i % 3).encode()}) for i, t in enumerate(texts)]
    tar = write_tar(str(tmp_path / "pairs-000.tar"), samples)
    res = shardtool.pack(tar, str(tmp_path / "ds"), tokenizer=tok, text_field="txt", eos_id=1)
    ds = shardtool.format.Dataset(res.out)
    for i in range(len(texts)):
        sample = ds.read(0, i)
        assert sample["tokens"].tolist() == tok.encode(texts[i]).ids + [1] and "txt" not in sample
    bad = write_tar(str(tmp_path / "bad-000.tar"), [*samples[:2], ("s999", {"txt": b"caf\xe9", "cls": b"0"})])
    with pytest.raises(BadSampleError, match=r"bad-000.tar.*--text-field 'txt' is not UTF-8 text"):
        shardtool.pack(bad, str(tmp_path / "bad"), tokenizer=tok, text_field="txt")
