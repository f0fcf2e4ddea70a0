"""Chat data at pack time (issue 37, item 2): conversations made from the standard library (the
user's turn: a function's signature; the assistant's: its docstring), rendered with a ChatML
template made here, tokenized with a tokenizer trained here (nothing is downloaded), an
assistant-only loss mask stored beside the tokens; checked token by token against decoding, then
through packed batches and a resume under torchrun."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

from helpers.runcli import shardtool_cli
from helpers.torchrun import torchrun
from shardtool.benchmarks.realdocs import stdlib_docstrings
from shardtool.format import Dataset, ShardtoolError
from shardtool.loader import ShardedLoader
from shardtool.pack import pack

END = "<|im_end|>"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ m['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
)
# The same turns without generation markers: the assistant's part is found turn by turn.
CHATML_PLAIN = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def stdlib_conversations(limit: int) -> list[dict]:
    """Signature → docstring exchanges; every fifth has a system turn, every third a second exchange."""
    pairs = stdlib_docstrings(2 * limit)
    out = []
    for i in range(limit):
        (sig, doc), (sig2, doc2) = pairs[2 * i], pairs[2 * i + 1]
        messages = [{"role": "system", "content": "You document Python."}] if i % 5 == 0 else []
        messages += [{"role": "user", "content": sig}, {"role": "assistant", "content": doc}]
        if i % 3 == 0:
            messages += [{"role": "user", "content": sig2}, {"role": "assistant", "content": doc2}]
        out.append({"id": f"c{i:05d}", "messages": messages})
    return out


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    """(conversations, their JSONL, a tokenizer directory with the ChatML template in its config)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("chat")
    convs = stdlib_conversations(400)
    jsonl = root / "chats.jsonl"
    with open(jsonl, "w") as f:
        for c in convs:
            f.write(json.dumps(c) + "\n")
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [m["content"] for c in convs for m in c["messages"]]
    specials = ["[UNK]", "<|endoftext|>", "<|im_start|>", END]
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=3000, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tokdir = root / "tok"
    tokdir.mkdir()
    tok.save(str(tokdir / "tokenizer.json"))
    with open(tokdir / "tokenizer_config.json", "w") as f:
        json.dump({"chat_template": CHATML, "eos_token": "<|endoftext|>"}, f)
    (root / "plain.jinja").write_text(CHATML_PLAIN)
    return convs, str(jsonl), str(tokdir), tok


def assistant_text(conv: dict) -> str:
    return "".join(m["content"] + END for m in conv["messages"] if m["role"] == "assistant")


def check_masks(ds_path: str, convs: list[dict], tok, eos: int | None) -> None:
    """Every sample: its tokens decode to the conversation; its masked tokens decode to exactly the
    assistant's turns (content and end marker), and nothing else is masked."""
    by_id = {c["id"]: c for c in convs}
    ds = Dataset(ds_path)
    n = 0
    for s in range(len(ds.manifest.shards)):
        for i in range(ds.manifest.shards[s].samples):
            sample = ds.read(s, i)
            ids, mask = sample["tokens"], sample["loss_mask"]
            assert ids.dtype == np.uint16 and mask.dtype == np.uint8 and len(ids) == len(mask)
            if eos is not None:
                assert ids[-1] == eos and mask[-1] == mask[-2]
                ids, mask = ids[:-1], mask[:-1]
            conv = by_id[sample["__key__"]]
            text = tok.decode(ids.tolist(), skip_special_tokens=False)
            assert assistant_text(conv) and text.count("<|im_start|>") == len(conv["messages"])
            assert tok.decode(ids[mask == 1].tolist(), skip_special_tokens=False) == assistant_text(conv)
            n += 1
    assert n == len(convs)


def test_the_tokenizers_template_with_generation_markers(chats, tmp_path):
    convs, jsonl, tokdir, tok = chats
    eos = tok.token_to_id("<|endoftext|>")
    out = str(tmp_path / "ds")
    res = shardtool_cli(
        "pack", jsonl, "-o", out, "--tokenizer", tokdir, "--chat-field", "messages", "--key", "id", "--eos-id", str(eos),
        timeout=180,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    check_masks(out, convs, tok, eos)


def test_a_template_file_without_markers_masks_the_same_turns(chats, tmp_path):
    convs, jsonl, tokdir, tok = chats
    out = str(tmp_path / "ds")
    template = os.path.join(os.path.dirname(jsonl), "plain.jinja")
    pack(
        jsonl,
        out,
        tokenizer=os.path.join(tokdir, "tokenizer.json"),
        chat_field="messages",
        chat_template=template,
        key="id",
        workers=2,
    )
    check_masks(out, convs, tok, None)
    marked = str(tmp_path / "marked")
    pack(jsonl, marked, tokenizer=tokdir, chat_field="messages", key="id")
    a, b = Dataset(out), Dataset(marked)
    for i in range(a.manifest.shards[0].samples):
        x, y = a.read(0, i), b.read(0, i)
        assert np.array_equal(x["tokens"], y["tokens"]) and np.array_equal(x["loss_mask"], y["loss_mask"])


@pytest.mark.parametrize("seq", [1024, 4096])
def test_packed_rows_train_only_the_assistants_tokens(chats, tmp_path, seq):
    convs, jsonl, tokdir, tok = chats
    eos = tok.token_to_id("<|endoftext|>")
    out = str(tmp_path / "ds")
    pack(jsonl, out, tokenizer=tokdir, chat_field="messages", key="id", eos_id=eos)
    by_id = {c["id"]: c for c in convs}
    ld = ShardedLoader(out, seq_len=seq, batch_size=2, rank=0, world_size=1, num_workers=0, drop_last=False)
    pieces = {}
    for batch in ld:
        ids, labels, mask = batch["input_ids"], batch["labels"], batch["loss_mask"]
        trained = labels != -100
        assert torch.equal(labels[:, :-1][trained[:, :-1]], ids[:, 1:][trained[:, :-1]])
        assert bool((mask[:, 1:][trained[:, :-1]] == 1).all())
        cu, offsets = batch["cu_seqlens"].tolist(), batch["doc_offsets"].tolist()
        keys = [k for row in batch["__key__"] for k in row]
        for k, key in enumerate(keys):
            a, z = cu[k], cu[k + 1]
            flat = torch.arange(a, z)
            # The piece's targets: the ids after each trained position, in order.
            sel = trained.reshape(-1)[flat[:-1]]
            pieces.setdefault(key, []).append((offsets[k], ids.reshape(-1)[flat[1:]][sel].tolist()))
    # Every conversation's trained targets, its pieces joined, are its assistant turns (less the
    # first token of a piece that continues another row).
    for key, parts in pieces.items():
        targets = [t for _, part in sorted(parts) for t in part]
        text = tok.decode([t for t in targets if t != eos], skip_special_tokens=False)
        want = assistant_text(by_id[key])
        if len(parts) == 1:
            # The turn's end marker is the last target: the eos after the conversation follows
            # the untrained newline after it, and takes its mask.
            assert text == want and targets[-1] == tok.token_to_id(END) and eos not in targets
        else:
            assert len(text) <= len(want)
    assert len(pieces) == len(convs)
    ld.close()


def test_resume_under_torchrun(chats, tmp_path):
    convs, jsonl, tokdir, tok = chats
    out = str(tmp_path / "ds")
    pack(jsonl, out, tokenizer=tokdir, chat_field="messages", key="id", eos_id=tok.token_to_id("<|endoftext|>"))
    work = str(tmp_path / "work")
    os.makedirs(work)
    for phase in ("first", "resumed"):
        res = torchrun("chat_worker.py", 2, "--data", out, "--out", work, "--phase", phase, timeout=200)
        assert res.returncode == 0, res.stderr[-4000:]
    for r in range(2):
        first = json.load(open(os.path.join(work, f"first.rank{r}.json")))
        resumed = json.load(open(os.path.join(work, f"resumed.rank{r}.json")))
        save_at = resumed["start"]
        assert resumed["steps"] == first["steps"][save_at:] and len(first["steps"]) > save_at > 0


def test_bad_conversations_and_options_are_named(chats, tmp_path):
    convs, jsonl, tokdir, tok = chats
    bad = tmp_path / "bad.jsonl"
    with open(bad, "w") as f:
        f.write(json.dumps(convs[0]) + "\n")
        f.write(json.dumps({"id": "x1", "messages": "hello"}) + "\n")
    with pytest.raises(
        ShardtoolError, match=r"bad.jsonl \(line 2\).*--chat-field 'messages' is not a list of messages"
    ):
        pack(str(bad), str(tmp_path / "o1"), tokenizer=tokdir, chat_field="messages", key="id")
    assert not os.path.exists(tmp_path / "o1" / "index.json")
    with pytest.raises(ShardtoolError, match="not both"):
        pack(jsonl, str(tmp_path / "o2"), tokenizer=tokdir, chat_field="messages", text_field="id")
    bare = tmp_path / "bare"  # a tokenizer.json alone: no template beside it
    bare.mkdir()
    shutil.copy(os.path.join(tokdir, "tokenizer.json"), bare / "tokenizer.json")
    with pytest.raises(ShardtoolError, match="no chat_template in its tokenizer_config.json"):
        pack(jsonl, str(tmp_path / "o3"), tokenizer=str(bare / "tokenizer.json"), chat_field="messages", key="id")
    # A tokenizer path that does not exist is named as such, not as a tokenizer without a template;
    # a template path that is no regular file, likewise.
    with pytest.raises(ShardtoolError, match="--tokenizer 'nosuchtok/': no such file"):
        pack(jsonl, str(tmp_path / "o3"), tokenizer="nosuchtok/", chat_field="messages", key="id")
    with pytest.raises(ShardtoolError, match="--chat-template '/dev/null': not a regular file"):
        pack(jsonl, str(tmp_path / "o3"), tokenizer=tokdir, chat_field="messages", chat_template="/dev/null")
    with pytest.raises(ShardtoolError, match="does not parse"):
        (tmp_path / "broken.jinja").write_text("{% for m in messages %}")
        pack(
            jsonl,
            str(tmp_path / "o4"),
            tokenizer=tokdir,
            chat_field="messages",
            chat_template=str(tmp_path / "broken.jinja"),
        )
    unstable = tmp_path / "unstable.jinja"  # the last turn rendered apart: turns cannot be found
    unstable.write_text("{% for m in messages %}{{ m['content'] }}{% if loop.last %}<|im_end|>{% endif %}{% endfor %}")
    with pytest.raises(ShardtoolError, match="add \\{% generation %\\} markers"):
        pack(
            jsonl, str(tmp_path / "o5"), tokenizer=tokdir, chat_field="messages", chat_template=str(unstable), key="id"
        )


def test_a_transformers_tokenizer_brings_its_template_and_agrees_with_its_mask(chats, tmp_path):
    from transformers import PreTrainedTokenizerFast

    convs, jsonl, tokdir, tok = chats
    hf = PreTrainedTokenizerFast(tokenizer_file=os.path.join(tokdir, "tokenizer.json"), eos_token="<|endoftext|>")
    hf.chat_template = CHATML
    out = str(tmp_path / "ds")
    pack(jsonl, out, tokenizer=hf, chat_field="messages", key="id")
    check_masks(out, convs, tok, None)
    ds = Dataset(out)
    for i in range(0, 60, 7):  # Hugging Face's own assistant mask of the same template, token for token
        sample = ds.read(0, i)
        conv = next(c for c in convs if c["id"] == sample["__key__"])
        theirs = hf.apply_chat_template(
            conv["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert list(theirs["input_ids"]) == sample["tokens"].tolist()
        assert list(theirs["assistant_masks"]) == sample["loss_mask"].tolist()


def test_the_fine_tuning_example_runs(tmp_path):
    import subprocess
    import sys

    from helpers.torchrun import ROOT

    cmd = [sys.executable, os.path.join(ROOT, "examples", "finetune_chat.py"), "--work", str(tmp_path / "w")]
    done = subprocess.run([*cmd, "--samples", "300", "--steps", "3"], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "trained tokens" in done.stdout and done.stdout.rstrip().endswith("ok")
