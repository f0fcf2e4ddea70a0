"""``shardtool warm`` on a dataset URL with no dataset there is an error (exit 2, naming it);
an unreachable source stays a logged remote failure that exits 0 without --strict."""

from __future__ import annotations

import json

import pytest

from helpers import faultfs  # noqa: F401  registers faulty://
from helpers.cachedata import make_dataset
from helpers.runcli import shardtool_cli
from helpers.s3server import free_port, s3_server  # noqa: F401  (fixture)
from shardtool.cache import RetryPolicy, warm

FAST = ["--retries", "1", "--attempt-timeout", "5", "--stall-timeout", "5"]


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_dataset(str(tmp_path_factory.mktemp("src") / "ds"), shards=2, samples=3)


def _warm_cli(url, cache_dir, *extra):
    return shardtool_cli("warm", url, "--cache-dir", cache_dir, "--all", "--quiet", "--json", *FAST, *extra)


@pytest.mark.parametrize("how", ["missing", "typo", "not-a-dataset", "file-url", "a-source-file"])
def test_a_local_path_with_no_dataset_is_a_usage_error(src, tmp_path, how):
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "raw.parquet").write_bytes(b"PAR1")  # a source file given by mistake: was exit 0, "remote failure"
    url = {
        "missing": str(tmp_path / "no" / "such" / "ds"),
        "typo": src + "x",
        "not-a-dataset": str(empty),
        "file-url": "file://" + str(tmp_path / "nope"),
        "a-source-file": str(tmp_path / "raw.parquet"),
    }[how]
    res = _warm_cli(url, str(tmp_path / "c"))
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "no dataset at" in res.stderr and url in res.stderr, res.stderr
    assert json.loads(res.stdout)["status"] == "usage_error"
    if how == "a-source-file":
        assert "is a file, not a dataset" in res.stderr


def test_cache_commands_on_a_file_are_a_usage_error(tmp_path):
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    for action in ("ls", "verify", "gc"):
        res = shardtool_cli("cache", action, "--cache-dir", str(tmp_path / "x.parquet"))
        assert res.returncode == 2 and "is a file, not a cache directory" in res.stderr, res.stderr
        assert "Traceback" not in res.stderr


def test_a_missing_prefix_in_a_reachable_bucket_is_a_usage_error(src, tmp_path, s3_server):  # noqa: F811
    url = s3_server.upload(src, "present/ds")
    opts = s3_server.storage_options
    r = warm(
        url + "-typo",
        str(tmp_path / "c"),
        all_shards=True,
        storage_options=opts,
        retry=RetryPolicy(attempts=2, base_delay=0.01),
    )
    assert r.status == "usage_error" and r.exit_code == 2 and url + "-typo" in r.error, r.error
    ok = warm(url, str(tmp_path / "c"), all_shards=True, storage_options=opts)
    assert ok.exit_code == 0 and ok.shards_copied == 2, ok.summary()


def test_an_unreachable_source_still_exits_0_without_strict(src, tmp_path):
    r = warm(
        "faulty://" + src,
        str(tmp_path / "c"),
        all_shards=True,
        storage_options={"refuse": True},
        retry=RetryPolicy(attempts=2, base_delay=0.01),
    )
    assert r.status == "remote_failed" and r.exit_code == 0
    # an S3 endpoint nobody listens on: unreachable, not missing
    opts = [
        "-o",
        f"client_kwargs.endpoint_url=http://127.0.0.1:{free_port()}",
        "-o",
        "key=k",
        "-o",
        "secret=s",
        "-o",
        "config_kwargs.retries.max_attempts=1",
        "-o",
        "config_kwargs.connect_timeout=2",
    ]
    res = _warm_cli("s3://bucket/ds", str(tmp_path / "c2"), *opts)
    assert res.returncode == 0 and "remote failure" in res.stderr, (res.returncode, res.stderr)
    assert _warm_cli("s3://bucket/ds", str(tmp_path / "c2"), *opts, "--strict").returncode == 1


def test_a_url_of_an_unknown_protocol_is_a_usage_error(tmp_path):
    url = "fiel://" + str(tmp_path / "ds")  # a typo of file://
    res = _warm_cli(url, str(tmp_path / "c"))
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "no dataset at" in res.stderr and url in res.stderr and "Traceback" not in res.stderr, res.stderr
