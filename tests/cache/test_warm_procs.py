"""warm as real processes: SIGKILL at random moments, concurrent warmers, two simulated nodes served
offline, S3 through a real moto server, and the SLURM prolog with a fake minimal environment."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

from helpers.cachedata import child_env, make_dataset
from helpers.prolog import prolog_conf, run_prolog
from helpers.s3server import s3_server  # noqa: F401  (fixture)
from shardtool.cache import VersionDir, assigned_shards, open_cache
from shardtool.cache.store import temp_path_for
from shardtool.format import open_dataset
from shardtool.format.hashing import hash_file
from shardtool.plan import Layout, Placement

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(REPO, "tests")
# The CLI in a subprocess, with faulty:// registered so tests can slow the source down.
CLI = [
    sys.executable,
    "-c",
    "import sys; sys.path.insert(0, sys.argv.pop(1)); from helpers import faultfs; "
    "from shardtool.cli import main; sys.exit(main(sys.argv[1:]))",
    TESTS,
]


def cli(*args, timeout=120, check=None):
    res = subprocess.run(
        CLI + ["warm", *map(str, args)], capture_output=True, text=True, env=child_env(), timeout=timeout
    )
    if check is not None:
        assert res.returncode == check, res.stderr
    return res


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_dataset(str(tmp_path_factory.mktemp("src") / "ds"), shards=12, samples=6, sample_bytes=40_000)


def assert_nothing_wrongly_trusted(cache_dir, src_ds):
    vd = VersionDir(cache_dir, src_ds.version)
    for i, s in enumerate(src_ds.manifest.shards):
        if vd.trusted(i, s):
            assert hash_file(vd.path(s.path))[0] == s.hash


@pytest.mark.timeout(180)
def test_sigkill_at_random_moments_then_rerun_finishes(src, tmp_path):
    ds = open_dataset(src)
    rng = random.Random(7)
    cache_dir = str(tmp_path / "c")
    for _ in range(5):
        p = subprocess.Popen(
            CLI + ["warm", "faulty://" + src, "--cache-dir", cache_dir, "--all", "--jobs", "3", "-o", "latency=0.01"],
            env=child_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(rng.uniform(0.3, 2.0))
        p.send_signal(signal.SIGKILL)
        p.wait(30)
        assert_nothing_wrongly_trusted(cache_dir, ds)
    res = cli(src, "--cache-dir", cache_dir, "--all", "--json", check=0)
    report = json.loads(res.stdout)
    assert report["shards_copied"] + report["shards_skipped"] == ds.num_shards and report["shards_failed"] == 0
    local = open_dataset(report["version_dir"])
    for i in range(ds.num_shards):
        assert local.read(i, 5) == ds.read(i, 5)
    again = json.loads(cli(src, "--cache-dir", cache_dir, "--all", "--json", check=0).stdout)
    assert again["shards_copied"] == 0
    # no shard temp of the killed warmers survives the reruns (their locks died with them)
    assert not [i for i in range(ds.num_shards) if os.path.exists(temp_path_for(local.shard_path(i)))]


@pytest.mark.timeout(120)
def test_two_concurrent_warmers_publish_each_shard_once(src, tmp_path):
    ds = open_dataset(src)
    cache_dir = str(tmp_path / "c")
    procs = [
        subprocess.Popen(
            CLI
            + [
                "warm",
                "faulty://" + src,
                "--cache-dir",
                cache_dir,
                "--all",
                "--jobs",
                "4",
                "-o",
                "latency=0.005",
                "--json",
            ],
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    reports = []
    for p in procs:
        out, err = p.communicate(timeout=100)
        assert p.returncode == 0, err
        reports.append(json.loads(out))
    assert sum(r["shards_copied"] for r in reports) == ds.num_shards  # no double download
    assert all(r["shards_copied"] + r["shards_skipped"] == ds.num_shards for r in reports)
    local = open_dataset(reports[0]["version_dir"])
    for i, s in enumerate(ds.manifest.shards):
        assert hash_file(local.shard_path(i))[0] == s.hash


@pytest.mark.timeout(120)
def test_two_nodes_two_ranks_served_from_cache_alone(src, tmp_path):
    moved = str(tmp_path / "source")
    shutil.copytree(src, moved)
    ds = open_dataset(moved)
    caches = {}
    for node in range(2):
        caches[node] = str(tmp_path / f"node{node}")
        cli(moved, "--cache-dir", caches[node], "--nodes", 2, "--node-rank", node, "--ranks-per-node", 2, check=0)
    os.rename(moved, moved + ".away")  # the source is now unreachable
    for node in range(2):
        c = open_cache(moved, caches[node])
        assert c.version == ds.version
        want = assigned_shards(c.dataset.summaries, Placement(Layout(2, 1), node))
        assert len(c.dataset.lengths) == len(ds)
        for i in want:
            with c.reading(i) as path:
                assert path.startswith(caches[node])
            assert c.local_shard(i) == path
            idx = c.dataset.shard_index(i)
            assert c.dataset.read(i, len(idx) - 1)["__key__"] == idx.keys[-1]
        others = [i for i in range(ds.num_shards) if i not in want]
        if others:
            from shardtool.cache import NotCached

            with pytest.raises(NotCached, match=ds.manifest.shards[others[0]].path):
                c.local_shard(others[0])


@pytest.mark.timeout(60)
def test_fetch_on_miss_fills_the_cache(src, tmp_path):
    c = open_cache(src, str(tmp_path))
    assert not c.is_cached(3)
    p = c.local_shard(3)
    assert c.is_cached(3) and hash_file(p)[0] == c.manifest.shards[3].hash
    assert c.dataset.read(4, 0) == open_dataset(src).read(4, 0)  # dataset.read fetches too
    assert c.is_cached(4)


@pytest.mark.timeout(120)
def test_s3_source_through_a_real_local_s3_server(src, tmp_path, s3_server):  # noqa: F811
    url = s3_server.upload(src, "warm-test/ds")
    ep = s3_server.endpoint
    cache_dir = str(tmp_path / "c")
    opts = [
        "-o",
        "key=testing",
        "-o",
        "secret=testing",
        "-o",
        f"client_kwargs.endpoint_url={ep}",
        "-o",
        "client_kwargs.region_name=us-east-1",
    ]
    res = cli(url, "--cache-dir", cache_dir, "--nodes", 2, "--node-rank", 0, "--json", *opts, check=0)
    report = json.loads(res.stdout)
    ds = open_dataset(src)
    assert report["shards_copied"] == len(assigned_shards(ds.summaries, Placement(Layout(2, 1), 0)))
    c = open_cache(url, cache_dir, storage_options=s3_server.storage_options)
    missing = next(i for i in range(ds.num_shards) if not c.is_cached(i))
    assert hash_file(c.local_shard(missing))[0] == ds.manifest.shards[missing].hash  # fetch-on-miss from S3
    # a missing object is a 404: one try, named, exit 1 under --strict
    s3_server.fs().rm(f"warm-test/ds/{ds.manifest.shards[0].path}")
    res = cli(url, "--cache-dir", str(tmp_path / "c2"), "--all", "--strict", "--retries", "5", *opts, check=1)
    assert ds.manifest.shards[0].path in res.stderr and "404" in res.stderr


def test_usage_errors_exit_2(src, tmp_path):
    assert cli(src, "--cache-dir", tmp_path, "--nodes", 3).returncode == 2
    assert cli(src, "--cache-dir", tmp_path, "--jobs", 0).returncode == 2
    assert (
        "exit codes" in subprocess.run(CLI + ["warm", "--help"], capture_output=True, text=True, env=child_env()).stdout
    )


@pytest.mark.timeout(120)
def test_prolog_with_a_fake_minimal_environment(src, tmp_path):
    hosts = ["gpu-a", "gpu-b", "gpu-c"]
    conf = prolog_conf(tmp_path, hosts, tmp_path / "cache", active=["42"], JOBS=4)
    os.makedirs(tmp_path / "cache")
    ds = open_dataset(src)
    for rank, node in enumerate(hosts):
        res = run_prolog(conf, node, job_id="42", nodelist="gpu-[a-c]", num_nodes=3, comment=f"shardtool:{src}")
        assert res.returncode == 0, res.stderr
        assert f"node {rank} of 3" in res.stderr
        report = json.load(open(tmp_path / "cache" / f"{node}.warm-42.json"))
        assert report["layout"]["node"] == rank and report["layout"]["num_nodes"] == 3
        assert report["assigned"] == len(assigned_shards(ds.summaries, Placement(Layout(3, 1), rank)))
    # a node whose cache root is gone is a local fault: the prolog exits non-zero (drain)
    conf = prolog_conf(tmp_path, hosts, tmp_path / "nope" / "x", JOBS=4)
    res = run_prolog(conf, "gpu-a", job_id="42", nodelist="gpu-[a-c]", num_nodes=3, comment=f"shardtool:{src}")
    assert res.returncode == 3, res.stderr
