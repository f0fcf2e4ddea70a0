"""`shardtool CMD | head`: a reader that closes the pipe ends the command quietly, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers.runcli import repo_env
from shardtool.pack.synthetic import write_synthetic


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_synthetic(str(tmp_path_factory.mktemp("pipe") / "ds"), 400, samples_per_shard=100, seed=0).root


def _with_closed_stdout(*args: str) -> subprocess.CompletedProcess:
    """``python -m shardtool ARGS`` writing into a pipe whose reader has already gone, as `| head`
    leaves it once head has its lines: every write fails with EPIPE, deterministically."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [sys.executable, "-m", "shardtool", *args],
            stdout=write_end,
            stderr=subprocess.PIPE,
            env=repo_env(),
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_end)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "{ds}"],
        ["inspect", "{ds}", "--json"],
        ["plan", "{ds}", "--nodes", "2", "--ranks-per-node", "2", "--max-tokens", "8192"],
        ["verify", "{ds}"],
        ["--help"],
        ["inspect", "--help"],
    ],
    ids=lambda a: " ".join(a).replace("{ds}", "DS"),
)
def test_a_closed_pipe_ends_the_command_quietly(dataset, argv):
    cp = _with_closed_stdout(*[a.replace("{ds}", dataset) for a in argv])
    assert "Traceback" not in cp.stderr and "BrokenPipeError" not in cp.stderr, cp.stderr
    # 128 + SIGPIPE, as `set -o pipefail` expects; argparse's help printer swallows the error itself.
    assert cp.returncode in ((0, 141) if "--help" in argv else (141,)), (cp.returncode, cp.stderr)


@pytest.mark.timeout(120)
def test_head_gets_its_line_and_the_shell_no_traceback(dataset):
    pipeline = f'"{sys.executable}" -m shardtool inspect "{dataset}" | head -1'
    cp = subprocess.run(
        ["bash", "-o", "pipefail", "-c", pipeline], env=repo_env(), capture_output=True, text=True, timeout=100
    )
    assert cp.stdout.startswith(dataset), cp.stdout
    assert "Traceback" not in cp.stderr, cp.stderr
