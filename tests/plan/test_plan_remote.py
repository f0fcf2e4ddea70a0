"""`shardtool plan` of a dataset on a real S3 API (moto), as a user runs it: the simulation of
every data group forks processes, and s3fs refuses use in a forked child ("This class is not
fork-safe"), so any layout of more than one node crashed with a traceback."""

from __future__ import annotations

import json
import os

import pytest

import shardtool
from helpers.realtext import byte_ids, stdlib_files
from helpers.runcli import repo_env
from helpers.s3server import CREDS, s3_server  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(240)


def _plan(url: str, *args: str, env: dict) -> dict:
    import subprocess
    import sys

    p = subprocess.run(
        [sys.executable, "-m", "shardtool", "plan", url, "--json", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout)


def test_plan_of_an_s3_dataset_over_several_nodes_equals_the_local_plan(s3_server, tmp_path):  # noqa: F811
    root = str(tmp_path / "ds")
    rows = [{"tokens": byte_ids(p)} for p in stdlib_files(150)]
    shardtool.pack(rows, root, length="tokens", shard_size=3_000_000)
    url = s3_server.upload(root, "planremote/ds")
    env = dict(
        repo_env(),
        AWS_ENDPOINT_URL=s3_server.endpoint,
        AWS_ACCESS_KEY_ID=CREDS["key"],
        AWS_SECRET_ACCESS_KEY=CREDS["secret"],
        AWS_DEFAULT_REGION="us-east-1",
    )
    for layout in (["--seq-len", "1024", "--batch-size", "2"], ["--batch-size", "4"]):
        args = ["--nodes", "2", "--ranks-per-node", "2", "--processes", "2", *layout]
        remote, local = _plan(url, *args, env=env), _plan(root, *args, env=env)
        assert remote["batches_per_rank"] == local["batches_per_rank"] > 0
        volatile = ("source", "plan_seconds", "peak_rss_mb")
        assert {k: v for k, v in remote.items() if k not in volatile} == {
            k: v for k, v in local.items() if k not in volatile
        }
    assert os.path.exists(root)


def test_the_cli_takes_storage_options_for_an_s3_dataset(s3_server, tmp_path):  # noqa: F811
    """plan, trace, inspect and verify had no --storage-option (only warm and upgrade did): an
    endpoint or credentials could reach them only through the environment."""
    import subprocess
    import sys

    root = str(tmp_path / "ds")
    shardtool.pack([{"tokens": byte_ids(p)} for p in stdlib_files(30)], root, length="tokens")
    url = s3_server.upload(root, "planremote/opts")
    env = {k: v for k, v in repo_env().items() if not k.startswith("AWS_")}
    opts = [
        "--storage-option",
        f"client_kwargs.endpoint_url={s3_server.endpoint}",
        "--storage-option",
        "client_kwargs.region_name=us-east-1",
        "--storage-option",
        f"key={CREDS['key']}",
        "--storage-option",
        f"secret={CREDS['secret']}",
    ]
    size = ["--seq-len", "512", "--batch-size", "2"]
    for cmd in (["plan", *size], ["trace", "--step", "0", *size], ["inspect"], ["verify", "-q"]):
        p = subprocess.run(
            [sys.executable, "-m", "shardtool", *cmd[:1], url, *cmd[1:], *opts],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode == 0, (cmd, p.stderr[-2000:])
