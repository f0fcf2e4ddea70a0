"""One rank of a Megatron-core run under torchrun (gloo, CPU): parallel_state's ranks, the
MegatronIterator, per-step batch hashes to a per-rank file, and a save/restore of its state."""

from __future__ import annotations

import argparse
import hashlib
import json

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from shardtool.integrations.megatron import build_iterator

MEGATRON_KEYS = {"tokens", "labels", "loss_mask", "position_ids", "cu_seqlens", "max_seqlen"}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-at", type=int)  # save the state into --ckpt after this many steps
    p.add_argument("--ckpt")
    p.add_argument("--restore")
    p.add_argument("--first-step", type=int, default=0)  # step number of the first batch (resumed runs)
    p.add_argument("--everywhere", action="store_true")
    a = p.parse_args()
    dist.init_process_group("gloo")
    ps.initialize_model_parallel(tensor_model_parallel_size=a.tp)
    it = build_iterator(a.data, seq_len=32, batch_size=2, num_workers=0, everywhere=a.everywhere, restore=a.restore)
    rank = dist.get_rank()
    with open(f"{a.out}.rank{rank}.jsonl", "w") as log:
        if it is None:
            log.write(json.dumps({"built": False}) + "\n")
        for step in range(a.first_step, a.first_step + a.steps if it is not None else 0):
            b = next(it)
            ok = (
                set(b) == MEGATRON_KEYS
                and b["loss_mask"].dtype == torch.float32
                and b["tokens"].shape == b["labels"].shape == b["loss_mask"].shape == b["position_ids"].shape
                and b["max_seqlen"].shape == (1,)
                and b["cu_seqlens"].dtype == torch.int32
            )
            digest = hashlib.sha256(b["tokens"].numpy().tobytes() + b["labels"].numpy().tobytes()).hexdigest()[:16]
            log.write(
                json.dumps({"step": step, "hash": digest, "ok": ok, "epoch": it.loader.state_dict()["epoch"]}) + "\n"
            )
            if a.save_at is not None and step + 1 == a.save_at:
                it.save_state(a.ckpt)
    dist.barrier()
    if it is not None:
        it.close()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
