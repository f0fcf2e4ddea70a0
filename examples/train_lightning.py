#!/usr/bin/env python
"""Train a tiny LM with PyTorch Lightning (DDP) on a shardtool dataset; resume mid-epoch exactly.

    python examples/train_lightning.py --data DATASET --devices 2            # CPU (gloo) or GPUs
    python examples/train_lightning.py --data DATASET --devices 2 --ckpt-dir ckpt/ --ckpt-every 50
    # ... killed or requeued: the same command with --resume ckpt/last.ckpt continues at the next batch

No torchrun: Lightning's DDP launcher starts the other ranks by running this script again. The
loaders are built in the DataModule's ``setup()``, once the process group exists, so each rank
gets its own DP rank. Lightning's own checkpoint carries the train loader's position; the
OneCycleLR schedule reads ``trainer.estimated_stepping_batches``, which without
`ShardedLoaderCallback` would make Lightning skip restoring it (Lightning issue #20550).

``--log-dir`` writes, per rank, one JSON line per training batch (epoch, step, sample keys, a
hash of the tokens) and per validation batch: the test suite compares runs with it.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint

from shardtool.integrations.lightning import LightningLoader, ShardedLoaderCallback
from shardtool.loader import ShardedLoader


class ShardedData(L.LightningDataModule):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.train = self.val = None

    def setup(self, stage: str) -> None:
        a = self.args
        if self.train is None:  # built once: the same loader serves every epoch and the resume
            # Rank and world size come from the process group Lightning started; ranks per node
            # (which ranks share a node's cache) Lightning does not export, so say it.
            common = dict(
                batch_size=a.batch_size,
                num_workers=a.num_workers,
                cache_dir=a.cache_dir,
                ranks_per_node=self.trainer.num_devices,
            )
            self.train = LightningLoader(ShardedLoader(a.data, seed=a.seed, **common))
            if a.val_data:
                self.val = LightningLoader(ShardedLoader(a.val_data, shuffle=False, drop_last=False, **common))

    def train_dataloader(self):
        # --bare: the ShardedLoader itself, as Lightning's docs would have it (resumes as exactly;
        # LightningLoader also follows Lightning's set_epoch and restarts a pass it cut short).
        return self.train.loader if self.args.bare else self.train

    def val_dataloader(self):
        return self.val


class TinyLM(L.LightningModule):
    def __init__(
        self,
        vocab: int = 1024,
        dim: int = 32,
        lr: float = 1e-2,
        schedule: bool = True,
        seq_len: int = 64,
        log_dir: str | None = None,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab)
        self._log = None

    def _loss(self, batch):
        tokens = batch["tokens"][:, : self.hparams.seq_len].long() % self.hparams.vocab
        logits = self.head(self.embed(tokens[:, :-1]))
        return F.cross_entropy(logits.reshape(-1, self.hparams.vocab), tokens[:, 1:].reshape(-1))

    def _record(self, kind: str, batch, batch_idx: int) -> None:
        if not self.hparams.log_dir:
            return
        if self._log is None:
            os.makedirs(self.hparams.log_dir, exist_ok=True)
            self._log = open(os.path.join(self.hparams.log_dir, f"batches.rank{self.global_rank}.jsonl"), "a")
        digest = hashlib.sha256(batch["tokens"].cpu().numpy().tobytes()).hexdigest()[:16]
        self._log.write(
            json.dumps(
                {
                    "kind": kind,
                    "epoch": self.current_epoch,
                    "step": self.global_step,
                    "batch_idx": batch_idx,
                    "keys": list(batch["__key__"]),
                    "hash": digest,
                }
            )
            + "\n"
        )
        self._log.flush()

    def on_fit_end(self):
        if self._log is not None:
            self._log.close()
            self._log = None

    def training_step(self, batch, batch_idx):
        self._record("train", batch, batch_idx)
        loss = self._loss(batch)
        self.log("train_loss", loss, batch_size=len(batch["__key__"]))
        return loss

    def validation_step(self, batch, batch_idx):
        if not self.trainer.sanity_checking:
            self._record("val", batch, batch_idx)
        self.log("val_loss", self._loss(batch), sync_dist=True, batch_size=len(batch["__key__"]))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        if not self.hparams.schedule:
            return opt
        # Reading estimated_stepping_batches builds the train loader before the checkpoint is read
        # (Lightning #20550): ShardedLoaderCallback restores the loader position Lightning then skips.
        total = self.trainer.estimated_stepping_batches
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=self.hparams.lr, total_steps=int(total))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Preempt(L.Callback):
    """Every rank exits at once after step ``step``, as a killed or preempted job would (no teardown)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step >= self.step:
            os._exit(3)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="dataset URL (path, s3://, ...)")
    p.add_argument("--val-data", default=None, help="a validation dataset (read in order, every sample once per run)")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--accelerator", default="auto")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=-1, help="stop after this many steps (-1: after --epochs)")
    p.add_argument("--num-workers", type=int, default=1)
    p.add_argument("--cache-dir", default=None, help="node-local cache directory (warmed by `shardtool warm`)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--no-schedule", action="store_true", help="a constant LR (no estimated_stepping_batches)")
    p.add_argument("--no-callback", action="store_true", help="leave out ShardedLoaderCallback (tests show why not)")
    p.add_argument("--bare", action="store_true", help="train_dataloader() returns the ShardedLoader itself")
    p.add_argument("--val-every", type=float, default=1.0, help="Trainer(val_check_interval=...)")
    p.add_argument("--ckpt-dir", default=None, help="save checkpoints here (step-N.ckpt and last.ckpt)")
    p.add_argument("--ckpt-every", type=int, default=50, help="steps between checkpoints")
    p.add_argument("--resume", default=None, help="a checkpoint to resume from (e.g. CKPT_DIR/last.ckpt)")
    p.add_argument(
        "--preempt-at-step", type=int, default=None, help="simulate a preemption: exit (status 3) after this step"
    )
    p.add_argument("--log-dir", default=None, help="per-rank JSONL of every batch's keys and hash")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    L.seed_everything(args.seed, workers=True)  # the model's random init; the data order is the loader's seed
    callbacks = [] if args.no_callback else [ShardedLoaderCallback()]
    if args.preempt_at_step:
        callbacks.append(Preempt(args.preempt_at_step))
    if args.ckpt_dir:  # Lightning runs checkpoint callbacks after the others: step N's is written before a preemption
        callbacks.append(
            ModelCheckpoint(
                dirpath=args.ckpt_dir,
                filename="step-{step}",
                every_n_train_steps=args.ckpt_every,
                save_top_k=-1,
                save_last=True,
            )
        )
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_epochs=args.epochs,
        max_steps=args.max_steps,
        callbacks=callbacks,
        val_check_interval=args.val_every,
        limit_val_batches=1.0 if args.val_data else 0,
        logger=False,
        enable_checkpointing=bool(args.ckpt_dir),
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.ckpt_dir or os.getcwd(),
    )
    model = TinyLM(lr=args.lr, schedule=not args.no_schedule, log_dir=args.log_dir)
    trainer.fit(model, datamodule=ShardedData(args), ckpt_path=args.resume)
    if trainer.global_rank == 0:
        print(json.dumps({"global_step": trainer.global_step, "epoch": trainer.current_epoch}), flush=True)
    # Lightning leaves the process group to the interpreter's exit, where Gloo's threads may still
    # hold work whose tensors need the GIL: the rank then aborts ("terminate called without an
    # active exception", seen once in CI after a clean fit). Free the DDP model (its Reducer holds
    # the group) while the group is registered, then destroy the group, as examples/train_hf.py does.
    del trainer, model
    gc.collect()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
