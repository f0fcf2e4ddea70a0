#!/usr/bin/env python
"""Train a tiny GPT-2 with the Hugging Face Trainer on a shardtool dataset; resume mid-epoch exactly.

    python examples/train_hf.py --data DATASET --output-dir out/                      # one process
    torchrun --nproc_per_node 2 examples/train_hf.py --data DATASET --output-dir out/ # DDP (gloo on CPU)
    # ... killed or requeued: the same command with --resume (the newest out/checkpoint-N) continues
    # at the next batch on every rank, without reading the batches already trained on

The loader packs documents into rows of ``--seq-len`` tokens (``input_ids``, ``labels``,
``position_ids``, which GPT-2's ``forward`` takes; the Trainer drops the other fields). It is
built before the Trainer: under torchrun its rank comes from torchrun's environment.
`ShardedTrainer` saves its position as ``shardtool_loader.json`` in every ``checkpoint-N``.

``--log-dir`` writes, per rank, one JSON line per training batch (global step, sample keys, a hash
of ``input_ids``): the test suite compares runs with it.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os

import torch
import transformers

from shardtool.integrations.hf import ShardedTrainer
from shardtool.loader import ShardedLoader


def batch_hash(input_ids: torch.Tensor) -> str:
    return hashlib.sha256(input_ids.cpu().numpy().tobytes()).hexdigest()[:16]


class RecordingTrainer(ShardedTrainer):
    """Writes every training batch this rank trains on (step before it, keys, input_ids hash) to ``log_dir``."""

    def __init__(self, *args, log_dir: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.log_dir = log_dir
        self._log = None

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.log_dir:
            if self._log is None:
                os.makedirs(self.log_dir, exist_ok=True)
                self._log = open(os.path.join(self.log_dir, f"batches.rank{self.args.process_index}.jsonl"), "a")
            keys = inputs.pop("__key__", None)  # kept for the log only (remove_unused_columns=False)
            self._log.write(
                json.dumps({"step": self.state.global_step, "keys": keys, "hash": batch_hash(inputs["input_ids"])})
                + "\n"
            )
            self._log.flush()
        # Ids of any corpus fold onto the tiny model's vocabulary (the README's corpus has ids up to
        # 49,999), as the other examples do; -100 labels stay ignored.
        vocab = self.model.config.vocab_size
        labels = inputs["labels"]
        inputs = {
            "input_ids": inputs["input_ids"] % vocab,
            "labels": torch.where(labels == -100, labels, labels % vocab),
            "position_ids": inputs["position_ids"],
        }
        return super().training_step(model, inputs, num_items_in_batch)


class Preempt(transformers.TrainerCallback):
    """Every rank exits at once after step ``step``, as a killed job would (the Trainer saves after this hook)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            os._exit(3)


def tiny_gpt2(vocab: int, seed: int) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(seed)  # random init, nothing downloaded
    config = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, n_positions=256, vocab_size=vocab, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="dataset URL (path, s3://, ...) of token documents")
    p.add_argument("--output-dir", required=True, help="the Trainer's output_dir (checkpoint-N folders)")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=2, help="packed rows per batch, per rank")
    p.add_argument("--vocab", type=int, default=30000)
    p.add_argument("--epochs", type=float, default=2)
    p.add_argument("--max-steps", type=int, default=-1, help="stop after this many steps (-1: after --epochs)")
    p.add_argument("--grad-accum", type=int, default=1, help="batches per optimizer step")
    p.add_argument("--ignore-data-skip", action="store_true", help="on resume, start the checkpoint's epoch over")
    p.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0: no checkpoints)")
    p.add_argument("--num-workers", type=int, default=1)
    p.add_argument("--cache-dir", default=None, help="node-local cache directory (warmed by `shardtool warm`)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=None,
        help="resume: from this checkpoint folder, or (no value) the newest in --output-dir",
    )
    p.add_argument(
        "--preempt-at-step", type=int, default=None, help="simulate a preemption: exit (status 3) after this step"
    )
    p.add_argument("--log-dir", default=None, help="per-rank JSONL of every batch's keys and input_ids hash")
    return p.parse_args(argv)


def build(args) -> RecordingTrainer:
    loader = ShardedLoader(
        args.data,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        seed=args.seed,
        num_workers=args.num_workers,
        cache_dir=args.cache_dir,
    )
    targs = transformers.TrainingArguments(
        output_dir=args.output_dir,
        num_train_epochs=args.epochs,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        ignore_data_skip=args.ignore_data_skip,
        learning_rate=1e-3,
        use_cpu=not torch.cuda.is_available(),
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        logging_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=args.seed,
        # keep __key__ for the log; RecordingTrainer passes the model only what it takes
        remove_unused_columns=not args.log_dir,
    )
    callbacks = [Preempt(args.preempt_at_step)] if args.preempt_at_step else []
    return RecordingTrainer(
        model=tiny_gpt2(args.vocab, args.seed),
        args=targs,
        train_loader=loader,
        callbacks=callbacks,
        log_dir=args.log_dir,
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    trainer = build(args)
    trainer.train(resume_from_checkpoint=args.resume)
    if trainer.args.process_index == 0:
        print(json.dumps({"global_step": trainer.state.global_step, "epoch": trainer.state.epoch}), flush=True)
    trainer.train_loader.close()
    # The Trainer leaves the process group to the interpreter's exit. There, or after
    # destroy_process_group, the last reference to the ProcessGroupGloo is the DDP model's
    # Reducer, freed with the GIL held while the group's threads wait for it: the rank hangs in
    # ~ProcessGroupGloo (seen in gdb) or aborts ("terminate called without an active exception").
    # Free the model first, while the group is still registered, then destroy the group.
    del trainer
    gc.collect()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
