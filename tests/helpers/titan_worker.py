"""One rank of a torchtitan-style run: a TitanLoader saved and restored by torchtitan's CheckpointManager.

  python titan_worker.py JOBS.json     forks every rank of every job (tests/helpers/forkranks.py)

A rank's argv: ``--out DIR --data ROOT --ckpt FOLDER [--save-every K] [--stop-at S]``. It loads
the newest ``step-N`` checkpoint in FOLDER if there is one (as torchtitan's trainer does at start),
then trains steps N+1, N+2, ... on the loader's batches until the epoch ends or step S, saving
every K steps. The batch of each step goes to DIR/steps.rank<r>.jsonl as {"step", "hash"}; a
refused load goes to DIR/error.rank<r>.txt.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the helpers package

from helpers.forkranks import run_jobs_file  # noqa: E402

ROWS, SEQ = 2, 33  # packed rows per batch; tokens per row (torchtitan's seq_len 32, plus the shifted label)


class TrainState:
    """The step counter torchtitan keeps in its checkpoint (its ``train_state``)."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        import torch

        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, sd):
        self.step = int(sd["step"])


def rank_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--save-every", type=int, default=10**9)
    p.add_argument("--stop-at", type=int, default=None)
    a = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torchtitan.components.checkpoint import CheckpointManager

    from shardtool.integrations.torchtitan import ShardedTitanDataLoader
    from shardtool.loader import LoaderStateError

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # built as torchtitan's trainer builds its dataloader (config.dataloader.build(...))
    titan = ShardedTitanDataLoader.Config(dataset_path=a.data, options={"num_workers": 0}).build(
        dp_rank=rank,
        dp_world_size=world,
        tokenizer=None,
        seq_len=SEQ - 1,
        local_batch_size=ROWS,
        snapshot_every_n_steps=None,
    )
    titan.epochs = 1  # the test reads one epoch (torchtitan itself stops at training.steps)
    loader = titan.loader
    model = torch.nn.Linear(2, 2)
    state = TrainState()
    ckpt = CheckpointManager(
        CheckpointManager.Config(enable=True, folder=a.ckpt, interval=a.save_every, keep_latest_k=0),
        dataloader=titan,
        model_parts=[model],
        optimizers=TrainState(),
        lr_schedulers=TrainState(),
        states={"train_state": state},
        sd_adapter=None,
    )
    try:
        ckpt.load()
    except LoaderStateError as e:
        with open(os.path.join(a.out, f"error.rank{rank}.txt"), "w") as f:
            f.write(str(e))
        return 3
    # the re-deal's leftover of the epoch resumed (the plan of the segment about to be served)
    leftover = {"leftover_batches": loader.plan.leftover_batches, "batches": loader.batches_left}
    with open(os.path.join(a.out, f"steps.rank{rank}.jsonl"), "w") as f:
        for input_dict, labels in titan:
            state.step += 1
            h = hashlib.sha256(input_dict["input"].numpy().tobytes() + labels.numpy().tobytes()).hexdigest()[:16]
            f.write(json.dumps({"step": state.step, "hash": h}) + "\n")
            f.flush()
            ckpt.save(state.step)
            if state.step == a.stop_at:
                break
    with open(os.path.join(a.out, f"leftover.rank{rank}.json"), "w") as f:
        json.dump(leftover, f)
    ckpt.close()
    titan.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(run_jobs_file(sys.argv[1], rank_main))
