"""A script that stops mid-pass and exits, keeping the loader and its iterator, exits quietly: its
suspended pass is ended before the interpreter tears its modules down (before, the garbage
collector ended it at teardown and Python printed "Exception ignored ... 'NoneType' object has
no attribute 'concatenate'")."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import shardtool

SCRIPT = """
import sys
from shardtool.loader import ShardedLoader
loaders = [ShardedLoader(sys.argv[1], batch_size=4, num_workers=w, pin_memory=False) for w in (0, 2)]
kept = [iter(ld) for ld in loaders]  # the iterators kept, as a training loop's variable is
for it in kept:
    next(it)
    next(it)
print("done")
"""


@pytest.mark.timeout(120)
def test_a_script_that_stops_mid_pass_and_exits_prints_nothing_more(tmp_path):
    rng = np.random.default_rng(0)
    rows = [{"tokens": rng.integers(0, 1000, int(n)).astype(np.int32)} for n in rng.integers(5, 300, 400)]
    root = str(tmp_path / "ds")
    shardtool.pack(rows, root, format="arrow", length="tokens")
    res = subprocess.run([sys.executable, "-c", SCRIPT, root], capture_output=True, text=True, timeout=100)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "done"
    assert "Exception ignored" not in res.stderr and "Traceback" not in res.stderr, res.stderr
