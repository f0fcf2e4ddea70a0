"""A torchtitan-style training loop on a ShardedLoader, checkpointed by torchtitan's CheckpointManager.

    torchrun --nproc_per_node 2 examples/train_torchtitan.py --data DS --ckpt ckpt --steps 200 --save-every 50

Run it again after a kill: it loads the newest ``step-N`` checkpoint (model, optimizer, the step,
and the loader's position) and trains step N+1 on the very batch the uninterrupted run would
have — also on another number of ranks, where the rest of the epoch is re-dealt. In torchtitan's
own trainer only the config line changes (``config.dataloader = ShardedTitanDataLoader.Config(...)``,
README "Using shardtool with torchtitan"); the trainer passes the DP rank and size, seq_len and
local_batch_size to its build() as below.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torchtitan.components.checkpoint import CheckpointManager

from shardtool.integrations.torchtitan import ShardedTitanDataLoader


class Step:
    """The step counter torchtitan keeps in its checkpoint (``train_state``)."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, sd):
        self.step = int(sd["step"])


class Optim:
    """What CheckpointManager expects of ``optimizers``: a Stateful (one optimizer here)."""

    def __init__(self, opt):
        self.opt = opt

    def state_dict(self):
        return {"lr": torch.tensor(self.opt.param_groups[0]["lr"])}

    def load_state_dict(self, sd):
        self.opt.param_groups[0]["lr"] = float(sd["lr"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="a shardtool dataset of token ids")
    p.add_argument("--ckpt", required=True, help="checkpoint folder (step-N subfolders)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4, help="packed rows per batch, per rank")
    p.add_argument("--vocab", type=int, default=32000)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    titan = ShardedTitanDataLoader.Config(dataset_path=args.data, options={"num_workers": 0}).build(
        dp_rank=rank,
        dp_world_size=world,
        tokenizer=None,
        seq_len=args.seq_len,
        local_batch_size=args.batch_size,
        snapshot_every_n_steps=None,
    )
    model = torch.nn.Sequential(torch.nn.Embedding(args.vocab, 32), torch.nn.Linear(32, args.vocab))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = Step()
    ckpt = CheckpointManager(
        # last_save_model_only=False: torchtitan's default saves only the weights at the last step,
        # and a run that is extended later (--steps more) must resume from that step's loader position too.
        CheckpointManager.Config(
            enable=True, folder=args.ckpt, interval=args.save_every, keep_latest_k=2, last_save_model_only=False
        ),
        dataloader=titan,
        model_parts=[model],
        optimizers=Optim(opt),
        lr_schedulers=Step(),
        states={"train_state": step},
        sd_adapter=None,
    )
    ckpt.load()  # the newest step-N, if any: the loader continues at the next batch
    if rank == 0 and step.step:
        print(f"resumed at step {step.step} (epoch {titan.loader.epoch})", flush=True)
    for inputs, labels in titan:
        step.step += 1
        logits = model(inputs["input"].clamp(max=args.vocab - 1))
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), labels.clamp(max=args.vocab - 1).flatten(), ignore_index=-100
        )
        opt.zero_grad()
        loss.backward()
        for prm in model.parameters():  # DDP's all-reduce, by hand, to keep the example short
            dist.all_reduce(prm.grad)
            prm.grad /= world
        opt.step()
        ckpt.save(step.step, last_step=step.step == args.steps)
        if rank == 0 and step.step % 10 == 0:
            print(f"step {step.step} loss {loss.item():.3f}", flush=True)
        if step.step == args.steps:
            break
    ckpt.close()
    titan.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
