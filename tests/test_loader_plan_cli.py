"""`shardtool plan`: the plan of a layout from metadata only, as text and JSON."""
from __future__ import annotations

import functools
import json

import pytest

from shardtool.loader import ShardedLoader
from runcli import shardtool_cli
from test_loader_data import write_dataset



shardtool = functools.partial(shardtool_cli, timeout=120)


@pytest.mark.timeout(150)
def test_plan_json_agrees_with_the_loaders(tmp_path):
    root, _ = write_dataset(str(tmp_path / "d"), [30, 30, 30, 30])
    out = shardtool("plan", root, "--nodes", "2", "--ranks-per-node", "2", "--batch-size", "4", "--seed", "3",
                    "--epoch", "1", "--json")
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    ld = ShardedLoader(root, rank=3, world_size=4, ranks_per_node=2, batch_size=4, seed=3, num_workers=0)
    ld.set_epoch(1)
    assert rep["batches_per_rank"] == len(ld)
    assert rep["remainder"] == ld.remainder.size
    assert abs(rep["padding_efficiency"] - ld.padding_efficiency) < 1e-12
    assert len(rep["per_node"]["shards"]) == 2 and sum(rep["per_node"]["samples"]) == 120
    assert rep["planning_seconds"] >= 0


@pytest.mark.timeout(150)
def test_plan_text_and_big_simulated_layouts(tmp_path):
    root, _ = write_dataset(str(tmp_path / "d"), [50] * 8)
    out = shardtool("plan", root, "--simulate-nodes", "4", "--ranks-per-node", "2", "--max-tokens", "200")
    assert out.returncode == 0, out.stderr
    for word in ("batches/rank", "padding eff.", "remainder", "shards/node", "bytes/node", "planning"):
        assert word in out.stdout
    big = shardtool("plan", "--synthetic", "300000", "--simulate-nodes", "1024", "--ranks-per-node", "8",
                    "--batch-size", "8", "--json")
    assert big.returncode == 0, big.stderr
    assert json.loads(big.stdout)["layout"]["world_size"] == 8192


@pytest.mark.timeout(150)
def test_plan_errors_are_clean(tmp_path):
    root, _ = write_dataset(str(tmp_path / "d"), [5])
    out = shardtool("plan", root, "--nodes", "8", "--ranks-per-node", "8", "--batch-size", "4")
    assert out.returncode == 1 and "too small" in out.stderr and "Traceback" not in out.stderr
