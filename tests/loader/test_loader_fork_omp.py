"""Loader workers are forked from a training process that has already used torch's intra-op
(OpenMP) thread pool. A forked child inherits that pool's bookkeeping but not its threads, so
its first parallel op would wait forever; the workers must still run a transform and a collate
that use parallel torch ops. Run in a fresh interpreter with a hard timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from test_loader_data import write_dataset

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from shardtool.loader import ShardedLoader

    torch.set_num_threads(2)  # intra-op threads > 1, whatever the machine
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):  # a training step: forward, backward, update, on the OpenMP pool
        loss = model(torch.randn(4096, 256)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.zeros(4096, 1024).add_(1)

    def transform(sample):  # above ATen's grain size: would run on the intra-op pool
        sample["noise"] = torch.ones(512, 512).mul_(2).sum().item()
        return sample

    def collate(samples):
        padded = torch.zeros(len(samples), 1 << 16)
        padded.add_(1)
        mixed = torch.randn(256, 256) @ torch.randn(256, 256)
        return {"__key__": [s["__key__"] for s in samples], "x": padded, "m": mixed}

    n = 0
    for batch in ShardedLoader(sys.argv[1], batch_size=4, num_workers=2, transform=transform,
                               collate_fn=collate, timeout=30):
        n += len(batch["__key__"])
    print("samples", n)
""")


@pytest.mark.timeout(150)
def test_workers_forked_after_a_training_step_run_parallel_torch_ops(tmp_path):
    root, keys = write_dataset(str(tmp_path / "d"), [12, 12])
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["PYTHONPATH"] = str(REPO)
    p = subprocess.run([sys.executable, "-c", SCRIPT, root], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    assert p.stdout.split() == ["samples", str(len(keys))]
