"""Fine-tuning on chat data: conversations packed with an assistant-only loss mask.

Makes conversations from the standard library (the user's turn: a function's signature; the
assistant's: its docstring) as JSONL, trains a small BPE tokenizer on them (nothing is
downloaded), and packs them with a ChatML template: ``shardtool pack chats.jsonl --tokenizer DIR
--chat-field messages`` stores the tokens and a ``loss_mask`` that is 1 on the assistant's
tokens. Then reads them packed into rows of ``--seq-len`` tokens and trains a tiny causal LM for a
few steps on the labels the loader built: -100 wherever the predicted token is not the
assistant's. Checks that every trained target is an assistant token. Needs the ``tokenize`` extra
(``pip install -e ".[tokenize]"``: tokenizers, jinja2).

    python examples/finetune_chat.py [--work DIR] [--seq-len 1024] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

import torch
import torch.nn.functional as F

from shardtool.benchmarks.realdocs import stdlib_docstrings
from shardtool.loader import ShardedLoader
from shardtool.pack import pack

# ChatML; the assistant's part (its content and end-of-turn marker) inside generation markers.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ m['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
)
SPECIALS = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def conversations(limit: int) -> list[dict]:
    """Signature → docstring exchanges of stdlib functions, as {"id", "messages"} records."""
    return [
        {"id": f"c{i:06d}", "messages": [{"role": "user", "content": sig}, {"role": "assistant", "content": doc}]}
        for i, (sig, doc) in enumerate(stdlib_docstrings(limit))
    ]


def tokenizer_dir(path: str, convs: list[dict]) -> str:
    """A byte-level BPE tokenizer trained on the conversations, with the template in its config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [m["content"] for c in convs for m in c["messages"]]
    trainer = trainers.BpeTrainer(
        vocab_size=2048, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": TEMPLATE, "eos_token": "<|endoftext|>", "pad_token": "<|pad|>"}, f)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="_work/finetune", help="where the data, tokenizer and dataset go (replaced)")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--samples", type=int, default=2000)
    args = ap.parse_args()

    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    convs = conversations(args.samples)
    jsonl = os.path.join(args.work, "chats.jsonl")
    with open(jsonl, "w") as f:
        for c in convs:
            f.write(json.dumps(c) + "\n")
    tok = tokenizer_dir(os.path.join(args.work, "tokenizer"), convs)
    ds = os.path.join(args.work, "chats")
    # As on the command line: shardtool pack chats.jsonl -o ds --tokenizer DIR --chat-field messages --key id
    result = pack(jsonl, ds, tokenizer=tok, chat_field="messages", key="id")
    print(result.summary())

    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(os.path.join(tok, "tokenizer.json")).get_vocab_size()
    torch.manual_seed(0)
    dim = 64
    model = torch.nn.Sequential(
        torch.nn.Embedding(vocab, dim), torch.nn.Linear(dim, dim), torch.nn.GELU(), torch.nn.Linear(dim, vocab)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = ShardedLoader(ds, seq_len=args.seq_len, batch_size=args.batch_size, num_workers=0, rank=0, world_size=1)
    for step, batch in enumerate(loader):
        if step == args.steps:
            break
        labels, mask = batch["labels"], batch["loss_mask"]
        target = labels != -100
        # A target is trained only where the token it predicts is the assistant's.
        assert bool((mask[:, 1:][target[:, :-1]] == 1).all()), "a target outside the assistant's turns"
        logits = model(batch["input_ids"])
        loss = F.cross_entropy(logits.view(-1, vocab), labels.view(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.3f}  trained tokens {int(target.sum())} of {labels.numel()}")
    loader.close()
    print("ok")


if __name__ == "__main__":
    main()
