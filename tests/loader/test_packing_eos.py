"""An EOS token appended at pack time is appended once: the manifest records it and the loader (and
`shardtool plan`) append none on top; another id is refused. On real text: stdlib files tokenized
with a BPE tokenizer trained on them."""

from __future__ import annotations

import json

import pytest

import shardtool
from helpers.realtext import train_tokenizer, write_stdlib_jsonl
from helpers.runcli import shardtool_cli
from shardtool.loader import Mixture, ShardedLoader

SUBDIRS = ("email", "json", "asyncio")


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    d = tmp_path_factory.mktemp("eos")
    texts = write_stdlib_jsonl(str(d / "code.jsonl"), subdirs=SUBDIRS)
    tok = train_tokenizer(texts)
    tok.save(str(d / "tokenizer.json"))
    eos = tok.token_to_id("[EOS]")
    r = shardtool_cli(
        "pack",
        str(d / "code.jsonl"),
        "-o",
        str(d / "with"),
        "--key",
        "id",
        "--text-field",
        "text",
        "--tokenizer",
        str(d / "tokenizer.json"),
        "--eos-id",
        str(eos),
        "--format",
        "arrow",
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    shardtool.pack(
        str(d / "code.jsonl"),
        str(d / "without"),
        key="id",
        text_field="text",
        tokenizer=str(d / "tokenizer.json"),
        format="arrow",
    )
    return d, eos


def _epoch(url, **kw) -> list[dict]:
    loader = ShardedLoader(url, seq_len=256, batch_size=4, num_workers=0, **kw)
    return [{k: v.clone() for k, v in b.items() if k in ("input_ids", "labels", "position_ids")} for b in loader]


def _doubled_eos(batches, eos: int) -> int:
    """Places where a document holds two EOS tokens in a row."""
    n = 0
    for b in batches:
        ids, pos = b["input_ids"], b["position_ids"]
        same_doc = pos[:, 1:] == pos[:, :-1] + 1
        n += int(((ids[:, 1:] == eos) & (ids[:, :-1] == eos) & same_doc).sum())
    return n


def test_the_manifest_records_the_packed_eos(packed):
    d, eos = packed
    assert shardtool.open_dataset(str(d / "with")).manifest.length["eos_id"] == eos
    assert "eos_id" not in shardtool.open_dataset(str(d / "without")).manifest.length


def test_the_loader_appends_no_second_eos_to_documents_packed_with_one(packed):
    d, eos = packed
    asked = _epoch(str(d / "with"), eos_id=eos)  # README: --eos-id at pack time, eos_id= at load time
    assert _doubled_eos(asked, eos) == 0
    plain = _epoch(str(d / "with"))
    assert len(asked) == len(plain) and all((a["input_ids"] == p["input_ids"]).all() for a, p in zip(asked, plain))
    # The same documents packed without an EOS and given one by the loader: the same rows.
    added = _epoch(str(d / "without"), eos_id=eos)
    assert len(added) == len(asked) and all((a["input_ids"] == b["input_ids"]).all() for a, b in zip(added, asked))
    # Every document ends with exactly one EOS: as many as documents served.
    ends = sum(int((b["input_ids"] == eos).sum()) for b in asked)
    docs = len(shardtool.open_dataset(str(d / "with")))
    assert docs * 0.98 <= ends <= docs


def test_another_eos_id_is_refused_naming_the_packed_one(packed):
    d, eos = packed
    with pytest.raises(ValueError, match=rf"already end with EOS id {eos} \(packed with --eos-id {eos}\)"):
        ShardedLoader(str(d / "with"), seq_len=256, batch_size=4, num_workers=0, eos_id=eos + 1)


def test_plan_counts_the_packed_eos_once(packed):
    d, eos = packed

    def plan(*extra):
        r = shardtool_cli("plan", str(d / "with"), "--seq-len", "256", "--batch-size", "4", "--json", *extra)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    with_flag, without_flag = plan("--eos-id", str(eos)), plan()
    for key in ("batches_per_rank", "fill_rate", "remainder_tokens_fraction", "rows_per_rank"):
        assert with_flag[key] == without_flag[key], key
    r = shardtool_cli("plan", str(d / "with"), "--seq-len", "256", "--batch-size", "4", "--eos-id", str(eos + 1))
    assert r.returncode != 0 and f"--eos-id {eos}" in r.stderr


def test_a_mixture_of_sources_packed_with_and_without_the_eos_is_refused(packed):
    d, eos = packed
    both = Mixture({"a": (str(d / "with"), 0.5), "b": (str(d / "with"), 0.5)})
    ld = ShardedLoader(both, steps=3, seq_len=256, batch_size=4, num_workers=0, eos_id=eos)
    assert _doubled_eos(list(ld), eos) == 0
    mixed = Mixture({"a": (str(d / "with"), 0.5), "b": (str(d / "without"), 0.5)})
    with pytest.raises(ValueError, match=r"mixture source 'b' do not"):
        ShardedLoader(mixed, steps=3, seq_len=256, batch_size=4, num_workers=0, eos_id=eos)
