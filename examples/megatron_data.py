"""The data part of a Megatron-LM pretrain script, from a shardtool dataset (``--dataloader-type external``).

Copy the two functions into ``pretrain_gpt.py`` (or your copy of it) and pass the provider:

    pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step)

    torchrun ... pretrain_gpt.py --dataloader-type external --data-path s3://bucket/ds \\
        --micro-batch-size 4 --seq-length 4096 --save ckpt --load ckpt --dataloader-save ckpt/data

Megatron calls the provider on tensor-parallel rank 0 and hands what it returns to its
``RerunDataIterator``; batches come with its key names (``tokens``, ``labels``, ``loss_mask``,
``position_ids``, and ``cu_seqlens``/``max_seqlen`` of the packed rows for
``PackedSeqParams(qkv_format="thd")``). With ``--dataloader-save`` Megatron's checkpointing calls
``save_state()`` and writes ``train_dataloader_dprank{r:03d}.pt`` per DP rank; the state being the
same on every rank, every rank restores from DP rank 0's file. No validation/test iterators: Megatron
skips evaluation for a None one.
"""

from __future__ import annotations

import os
from typing import Any

from shardtool.integrations.megatron import MegatronIterator, build_iterator

STATE_BASENAME = "train_dataloader_dprank000.pt"  # every DP rank's file holds the same state: use rank 0's


def build_train_iterator(args: Any, checkpoint_name: Any = None) -> MegatronIterator | None:
    """The train iterator for Megatron's ``args`` (``data_path``, ``micro_batch_size``, ``seq_length``,
    ``load``, ``iteration``, ``dataloader_save``); None where Megatron reads no data.
    ``checkpoint_name``: Megatron's ``get_checkpoint_name`` (where it saved the loader state)."""
    restore = None
    if getattr(args, "load", None) and getattr(args, "dataloader_save", None) and checkpoint_name is not None:
        path = checkpoint_name(args.dataloader_save, args.iteration, pipeline_rank=0, basename=STATE_BASENAME)
        if os.path.exists(path):
            import torch

            restore = torch.load(path, weights_only=True)  # {"dataloader_state_dict": the state}: a plain dict
    url = args.data_path[0] if isinstance(args.data_path, (list, tuple)) else args.data_path
    return build_iterator(
        url,
        seq_len=args.seq_length,
        batch_size=args.micro_batch_size,
        num_workers=getattr(args, "num_workers", 2),
        restore=restore,
    )


def train_valid_test_datasets_provider(train_val_test_num_samples: Any):
    """Megatron-LM's provider: (train, valid, test) iterators, passed through by ``--dataloader-type external``."""
    from megatron.training import get_args
    from megatron.training.checkpointing import get_checkpoint_name

    return build_train_iterator(get_args(), get_checkpoint_name), None, None
