"""What a loader process pays before its first batch, where every worker would pay it again: no
pandas import (pyarrow's to_numpy and compute import it, ~0.3 s), and the modules a worker needs
for its first shard imported in the trainer, so forked workers inherit them."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shardtool
from helpers.realdata import icon_tree
from helpers.runcli import repo_env
from shardtool.format.sindex import _bad_keys_compute, bad_keys

PROBE = """
import json, sys
import torch
from shardtool.loader import ShardedLoader
loader = ShardedLoader(sys.argv[1], batch_size=8, num_workers=0, rank=0, world_size=1, metrics=False)
built = sorted(m for m in sys.modules if m.startswith("shardtool.cache"))
next(iter(loader))
print(json.dumps({"pandas": "pandas" in sys.modules, "cache_modules_at_construction": built}))
"""


@pytest.mark.timeout(120)
def test_a_fresh_loader_reaches_its_first_batch_without_importing_pandas(tmp_path):
    icon_tree(tmp_path / "icons", per_class=5)
    shardtool.pack(str(tmp_path / "icons"), str(tmp_path / "ds"), label_from_dir=True)
    r = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path / "ds")], env=repo_env(), capture_output=True, text=True, timeout=100
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["pandas"] is False
    # the in-place verifier's modules are there before any worker would fork
    assert "shardtool.cache.usercache" in got["cache_modules_at_construction"]


ALPHABET = st.sampled_from(["a", "Z", "0", "-", "_", ".", "/", "\\", "\x00", "\x1f", "\n", "é", "€", "𝄞", "x" * 90])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(ALPHABET, max_size=4).map("".join), max_size=8), st.integers(0, 2), st.booleans())
def test_key_check_by_bytes_finds_what_the_regex_finds(keys, cut, large):
    arr = pa.array(keys, pa.large_string() if large else pa.string()).slice(min(cut, len(keys)))
    assert bad_keys(arr) == _bad_keys_compute(arr)
    assert bad_keys(pa.chunked_array([arr, arr], arr.type)) == _bad_keys_compute(pa.concat_arrays([arr, arr]))
