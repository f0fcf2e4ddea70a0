"""What a user reads: the warm summary says which layout it assumed; every option explains itself."""

import subprocess
import sys

from helpers.cachedata import child_env, make_dataset
from helpers.runcli import shardtool_cli


def test_warm_without_a_layout_says_it_assumed_one_node(tmp_path):
    # It used to copy everything, silently, as if the job had one node.
    src = make_dataset(str(tmp_path / "ds"), shards=4, samples=5)
    res = subprocess.run(
        [sys.executable, "-m", "shardtool", "warm", src, "--cache-dir", str(tmp_path / "c"), "-q"],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert "node 0 of 1" in res.stderr and "from default: one node (no --nodes, no SLURM environment)" in res.stderr
    env = {**child_env(), "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "1"}
    res = subprocess.run(
        [sys.executable, "-m", "shardtool", "warm", src, "--cache-dir", str(tmp_path / "c2"), "-q"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0 and "node 1 of 2" in res.stderr and "SLURM_NODEID" in res.stderr, res.stderr


def test_every_option_has_help_text():
    from shardtool.cli import build_parser

    missing = []
    parser = build_parser()
    for name, sub in parser._subparsers._group_actions[0].choices.items():
        for action in sub._actions:
            if action.option_strings and action.help in (None, "") and action.dest != "help":
                missing.append(f"{name} {'/'.join(action.option_strings)}")
    assert not missing, f"options without help: {missing}"
    for command, needle in (("plan", "shuffle seed"), ("bench", "samples per batch")):
        out = shardtool_cli(command, "--help")
        assert out.returncode == 0 and needle in out.stdout, out.stdout
