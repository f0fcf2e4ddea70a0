#!/usr/bin/env python
"""Train a tiny transformer LM with DDP on a shardtool dataset, with checkpoint/resume.

Run under torchrun (CPU/gloo here, GPU/nccl when CUDA is present):

    torchrun --nproc_per_node=2 examples/train_ddp.py --data DATASET --max-tokens 4096 \
        --cache-dir /local/nvme/shardtool --ckpt-dir ckpt/ --log-dir logs/

Compared with a DataLoader + DistributedSampler script, two lines change: the import and the
construction of the loader. The loader's ``state_dict()`` goes into the same checkpoint as the
model and optimizer, so a killed or requeued job resumes at exactly the next batch.

Every ``--metrics-every`` steps each rank's loader appends a metric line to a node-local file
(``--metrics-dir``, default under the cache dir or $TMPDIR), rank 0 prints one line of its
loader metrics and, with several ranks, logs which rank waited longest for data. Afterwards,
``shardtool stats DIR...`` merges the files of every node.

A mixture of datasets (weights in tokens, see docs/mixtures.md) runs for --steps steps
instead of epochs, and may resume under other weights:

    torchrun --nproc_per_node=2 examples/train_ddp.py --mixture mix.json --steps 1000 --seq-len 512 \
        --packing best-fit --batch-size 8 --ckpt-dir ckpt/
    # ... killed; requeued with new weights from the checkpoint's step on:
    torchrun --nproc_per_node=2 examples/train_ddp.py --mixture mix.json --steps 1000 ... \
        --ckpt-dir ckpt/ --weights web=0.5,code=0.3,math=0.2
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from shardtool.format.sizes import format_size
from shardtool.loader import ShardedLoader  # changed line 1 of 2
from shardtool.loader import Mixture  # only for --mixture


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int = 64, layers: int = 2, heads: int = 4, max_len: int = 8192):
        super().__init__()
        self.vocab, self.heads = vocab, heads
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(max_len, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, dim * 2, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor | None = None, attend: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``attend`` [B, 1, S, S] (True = may attend, e.g. shardtool.loader.packed.block_causal_mask):
        packed rows attend within their documents only; default: plain causal."""
        n = tokens.shape[1]
        if positions is None:
            positions = torch.arange(n, device=tokens.device).expand_as(tokens)
        if attend is None:
            mask = torch.triu(torch.ones(n, n, dtype=torch.bool, device=tokens.device), diagonal=1)
        else:  # nn.Transformer's bool masks say where NOT to attend, one per (batch, head)
            mask = (~attend[:, 0]).repeat_interleave(self.heads, dim=0)
        return self.head(self.blocks(self.embed(tokens) + self.position(positions), mask=mask))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="dataset URL (path, file://, s3://, ...)")
    src.add_argument("--mixture", help="a mixture file (JSON/YAML: datasets and token weights); runs --steps steps")
    p.add_argument("--steps", type=int, default=None, help="with --mixture: the run's length in steps (global batches)")
    p.add_argument(
        "--weights",
        default=None,
        metavar="NAME=W,...",
        help="with --mixture: these weights instead of the file's (and its schedule), e.g. at a resume: "
        "every source continues from where it was",
    )
    p.add_argument("--cache-dir", default=None, help="node-local cache directory (warmed by `shardtool warm`)")
    p.add_argument("--field", default=None, help="token field (default: the dataset's length field)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--batch-size", type=int, default=None)
    g.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps in total")
    p.add_argument(
        "--seq-len",
        type=int,
        default=128,
        help="truncate sequences to this many tokens for the model; with --packing, the length of every packed row",
    )
    p.add_argument(
        "--packing",
        choices=["best-fit", "concat", "no-split"],
        default=None,
        help="pack documents into rows of exactly --seq-len tokens (with --batch-size rows per batch); "
        "no token attends across a document boundary",
    )
    p.add_argument(
        "--eos-id", type=int, default=None, help="with --packing: an end-of-sequence token after each document"
    )
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--num-workers", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ckpt-dir", default=None, help="save checkpoints here and resume from the latest one")
    p.add_argument("--ckpt-every", type=int, default=10, help="steps between checkpoints")
    p.add_argument("--log-dir", default=None, help="write per-rank JSONL logs of sample keys and stats here")
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (to simulate a bigger model)")
    p.add_argument("--collective-timeout", type=float, default=120.0, help="seconds before a stuck collective fails")
    p.add_argument(
        "--stall-timeout",
        type=float,
        default=None,
        help="seconds a batch may take before the loader raises, naming the shard it reads and dumping "
        "the stacks (default: half of --collective-timeout, so that a rank stuck on its data is "
        "named instead of its peers timing out in a collective)",
    )
    p.add_argument(
        "--metrics-every",
        type=int,
        default=50,
        help="steps between loader metric lines (JSONL per rank; rank 0 prints one); 0: none",
    )
    p.add_argument(
        "--metrics-dir",
        default=None,
        help="node-local directory for the metric lines (default: <cache-dir>/metrics/<run> or $TMPDIR)",
    )
    return p.parse_args(argv)


def packed_step(model, batch: dict, vocab: int, device) -> torch.Tensor:
    """Loss on packed rows: per-document positions and a block-diagonal causal mask, so no token
    sees another document; labels are -100 across document boundaries and on padding."""
    from shardtool.loader.packed import block_causal_mask

    tokens = batch["input_ids"].to(device, non_blocking=True) % vocab
    labels = batch["labels"].to(device, non_blocking=True)
    labels = torch.where(labels >= 0, labels % vocab, labels)
    logits = model(tokens, batch["position_ids"].to(device), block_causal_mask(batch).to(device))
    return F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1), ignore_index=-100)


def metrics_line(rank: int, step: int, m: dict) -> str:
    """One line of the loader's metrics since the previous line: what a training log shows."""
    w = m["window"]
    hit = w["cache"]["hit_rate"]
    read = ", ".join(f"{t} {format_size(n)}" for t, n in w["bytes_read"].items() if n) or "nothing new"
    # No hit rate: the window opened no shard (its readers hold theirs open), not a failing cache.
    cache = "no shard opened" if hit is None else f"cache hit {100 * hit:.0f}%"
    return (
        f"[rank {rank}] step {step}: data wait {100 * (w['wait_fraction'] or 0):.1f}%, "
        f"{w['tokens_per_s'] or 0:,.0f} tokens/s, {w['samples_per_s'] or 0:,.0f} samples/s, "
        f"{cache}, read {read}"
    )


def mixture_of(args) -> Mixture:
    if args.steps is None:
        raise SystemExit("--mixture needs --steps N: a mixture has no epoch")
    mixture = Mixture.from_file(args.mixture)
    if args.weights:
        pairs = [item.split("=", 1) for item in args.weights.split(",") if item]
        mixture = mixture.with_weights({name: value for name, value in pairs})
    return mixture


def save_checkpoint(path: str, payload: dict) -> None:
    # Temp file + rename: a kill while saving keeps the previous checkpoint intact.
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(payload, tmp)
    os.replace(tmp, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    )
    if distributed:
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=args.collective_timeout)
        )
    rank = dist.get_rank() if distributed else 0
    torch.manual_seed(args.seed)

    if args.packing:
        args.batch_size = args.batch_size or 8
        pack = dict(seq_len=args.seq_len, packing=args.packing, eos_id=args.eos_id)
    else:
        pack = {}
        if args.batch_size is None and args.max_tokens is None:
            args.max_tokens = 4096
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("shardtool.loader.metrics").setLevel(logging.INFO)  # rank 0's cross-rank summary
    data, length = args.data, {}
    if args.mixture:
        data, length = mixture_of(args), {"steps": args.steps}
    loader = ShardedLoader(
        data,
        batch_size=args.batch_size,
        max_tokens=args.max_tokens,  # changed line 2 of 2
        seed=args.seed,
        num_workers=args.num_workers,
        cache_dir=args.cache_dir,
        metrics_every=args.metrics_every,
        metrics_dir=args.metrics_dir,
        metrics_reduce=distributed,
        stall_timeout=args.stall_timeout or args.collective_timeout / 2,
        **pack,
        **length,
    )
    field = args.field or loader.length_field

    model = TinyLM(args.vocab, max_len=max(args.seq_len, 1)).to(device)
    ddp = nn.parallel.DistributedDataParallel(model) if distributed else model
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr)

    step, epoch = 0, 0
    ckpt_path = os.path.join(args.ckpt_dir, "latest.pt") if args.ckpt_dir else None
    if ckpt_path and os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device, weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optim"])
        loader.load_state_dict(ck["loader"])
        step, epoch = ck["step"], 0 if args.mixture else loader.epoch
        print(f"[rank {rank}] resumed from step {step} (epoch {epoch})", flush=True)

    log = None
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
        log = open(os.path.join(args.log_dir, f"keys.rank{rank}.jsonl"), "a")

    t0 = time.perf_counter()
    done = False
    while (args.mixture or epoch < args.epochs) and not done:
        if args.mixture:
            done = True  # a mixture has no epochs: one pass serves its --steps steps
        else:
            loader.set_epoch(epoch)
        for batch in loader:
            if args.packing:
                loss = packed_step(ddp, batch, args.vocab, device)
            else:
                tokens = batch[field][:, : args.seq_len].to(device, non_blocking=True) % args.vocab
                logits = ddp(tokens[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if log:
                log.write(
                    json.dumps(
                        {
                            "epoch": epoch,
                            "step": step,
                            "loss": round(loss.item(), 4),
                            "keys": list(batch["__key__"]),
                            "source": batch.get("__source__"),
                        }
                    )
                    + "\n"
                )
                log.flush()
            if args.metrics_every and step % args.metrics_every == 0 and rank == 0:
                print(metrics_line(rank, step, loader.metrics()), flush=True)
            if ckpt_path and step % args.ckpt_every == 0:
                if rank == 0:
                    os.makedirs(args.ckpt_dir, exist_ok=True)
                    save_checkpoint(
                        ckpt_path,
                        {
                            "model": model.state_dict(),
                            "optim": opt.state_dict(),
                            "loader": loader.state_dict(),
                            "step": step,
                        },
                    )
                if distributed:
                    dist.barrier()
            if args.max_steps and step >= args.max_steps:
                done = True
                break
        else:
            epoch += 1
    elapsed = time.perf_counter() - t0
    summary = {
        "rank": rank,
        "steps": step,
        "epochs_done": epoch,
        "seconds": round(elapsed, 3),
        "batches_per_epoch": len(loader),
    }
    summary["loader"] = loader.metrics()["cumulative"]
    summary["metrics_file"] = loader.metrics_path
    if args.mixture:
        summary["mixture"] = loader.report()
    print(json.dumps(summary), flush=True)
    if args.log_dir:
        with open(os.path.join(args.log_dir, f"summary.rank{rank}.json"), "w") as f:
            json.dump(summary, f)
    if log:
        log.close()
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
