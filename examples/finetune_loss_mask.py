"""Fine-tuning data through packing: a loss mask on the answer's tokens only.

Makes "conversations" from the standard library (the user's turn: a function's signature; the
assistant's: its docstring), as byte ids with a ``loss_mask`` that is 1 on the assistant's bytes;
packs them; reads them packed into rows of ``--seq-len`` tokens; trains a tiny causal LM for a few
steps on the labels the loader built (-100 wherever the predicted token is not the assistant's).
Checks on the way that every trained target is an assistant byte and that each was trained once.

    python examples/finetune_loss_mask.py [--work DIR] [--seq-len 512] [--steps 40]
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import sysconfig

import numpy as np
import torch
import torch.nn.functional as F

from shardtool.loader import ShardedLoader
from shardtool.pack import pack

PAD, EOS, USER, ASSISTANT = 0, 1, 2, 3  # ids below 4 are markers; a byte b is id b + 4
VOCAB = 260


def conversations(limit: int) -> list[dict]:
    """(signature, docstring) pairs of stdlib functions as samples: tokens, loss_mask, key."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for name in sorted(os.listdir(root)):
        if not name.endswith(".py"):
            continue
        try:
            tree = ast.parse(open(os.path.join(root, name), encoding="utf-8").read())
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and ast.get_docstring(node):
                user = f"def {node.name}({ast.unparse(node.args)}):".encode()
                answer = ast.get_docstring(node).encode()
                ids = np.concatenate(
                    [[USER], np.frombuffer(user, np.uint8) + 4, [ASSISTANT], np.frombuffer(answer, np.uint8) + 4]
                )
                mask = np.zeros(len(ids), np.uint8)
                mask[len(user) + 2 :] = 1  # the answer's bytes: the tokens to learn to produce
                out.append(
                    {
                        "__key__": f"{name[:-3]}-{node.name}-{len(out)}",
                        "tokens": ids.astype(np.int16),
                        "loss_mask": mask,
                    }
                )
                if len(out) == limit:
                    return out
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="_work/finetune", help="where the dataset is written (replaced)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--samples", type=int, default=2000)
    args = ap.parse_args()

    samples = conversations(args.samples)
    ds = os.path.join(args.work, "chats")
    shutil.rmtree(ds, ignore_errors=True)
    pack(samples, ds, length="tokens", key="__key__")
    answer_bytes = sum(int(s["loss_mask"].sum()) for s in samples)
    print(
        f"packed {len(samples)} conversations ({answer_bytes} answer bytes of {sum(len(s['tokens']) for s in samples)}) to {ds}"
    )

    torch.manual_seed(0)
    dim = 64
    model = torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, dim), torch.nn.Linear(dim, dim), torch.nn.GELU(), torch.nn.Linear(dim, VOCAB)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = ShardedLoader(
        ds, seq_len=args.seq_len, batch_size=args.batch_size, eos_id=EOS, num_workers=0, rank=0, world_size=1
    )
    trained = 0
    for step, batch in enumerate(loader):
        labels, mask = batch["labels"], batch["loss_mask"]
        target = labels != -100
        # A target is trained only where the token it predicts is the assistant's (the eos after
        # an answer included: it takes the mask of the answer's last byte).
        assert bool((mask[:, 1:][target[:, :-1]] == 1).all()), "a target outside the answers"
        trained += int(target.sum())
        if step < args.steps:
            logits = model(batch["input_ids"])
            loss = F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % 10 == 0 or step == args.steps - 1:
                print(f"step {step:3d}  loss {loss.item():.3f}  trained tokens {int(target.sum())} of {labels.numel()}")
    loader.close()
    # Every answer byte is a target once, and so is the eos after each answer (it takes the mask
    # of the answer's last byte); less the first token of a piece continued from the row before,
    # and the rows left over to give every rank the same count.
    most = answer_bytes + len(samples)
    print(f"one pass: {trained} trained targets of at most {most} (answer bytes + one eos each)")
    assert 0.9 * most < trained <= most, (trained, most)
    print("ok")


if __name__ == "__main__":
    main()
