"""examples/slurm/prolog.sh for a shared cluster, as SLURM runs it (no PATH, a minimal environment,
fake scontrol/squeue): each job stages what its comment asks for; only node faults exit non-zero; the
job's own mistakes reach its loader; a source gone after a warm is served from the node's cache;
a budget evicts versions no running job asked for first. (The real cluster: tests/slurm/.)"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from helpers.cachedata import child_env, make_dataset
from helpers.prolog import prolog_conf, run_prolog
from shardtool.cache import VersionDir, open_cache
from shardtool.cache.jobs import read_job_record
from shardtool.format import open_dataset

NODE = "n1"
# A rank that trains from the node cache inside job $SLURM_JOB_ID; prints its batch count, or the error.
LOADER = """
import sys, warnings
from shardtool.loader import ShardedLoader
warnings.simplefilter("always")
try:
    loader = ShardedLoader(sys.argv[1], batch_size=2, shuffle=False, rank=0, world_size=1, ranks_per_node=1,
                           num_workers=0, cache_dir=sys.argv[2], metrics=False)
    print("batches", sum(1 for _ in loader))
except Exception as e:
    print(f"{type(e).__name__}: {e}")
    sys.exit(1)
"""


def train(url, cache_dir, job):
    env = {**child_env(), "SLURM_JOB_ID": str(job)}
    return subprocess.run(
        [sys.executable, "-c", LOADER, str(url), str(cache_dir)], capture_output=True, text=True, env=env, timeout=120
    )


def stage(conf, job, comment, **kw):
    return run_prolog(conf, NODE, job_id=str(job), nodelist=NODE, num_nodes=1, comment=comment, **kw)


@pytest.fixture
def datasets(tmp_path):
    return [make_dataset(str(tmp_path / f"ds{i}"), shards=4, samples=4, sample_bytes=8_000, seed=i) for i in range(3)]


def cached_shards(cache_dir, url) -> set[int]:
    ds = open_dataset(url)
    vd = VersionDir(str(cache_dir), ds.version)
    return {i for i, info in enumerate(ds.manifest.shards) if vd.trusted(i, info)}


def total_bytes(url) -> int:
    return sum(s.bytes for s in open_dataset(url).manifest.shards)


@pytest.mark.timeout(120)
def test_nothing_asked_nothing_staged(tmp_path, datasets):
    conf = prolog_conf(tmp_path, [NODE], tmp_path / "cache", active=["1"])
    os.makedirs(tmp_path / "cache")
    for comment in (None, "an unrelated comment"):
        res = stage(conf, 1, comment)
        assert res.returncode == 0 and "asks for nothing" in res.stderr, res.stderr
    assert os.listdir(tmp_path / "cache") == []
    # no config at all: nothing to do, no drain
    res = run_prolog(
        str(tmp_path / "missing.conf"), NODE, job_id="1", nodelist=NODE, num_nodes=1, comment=f"shardtool:{datasets[0]}"
    )
    assert res.returncode == 0 and "no config" in res.stderr


@pytest.mark.timeout(180)
def test_the_jobs_mistakes_exit_0_and_fail_its_loader(tmp_path, datasets):
    conf = prolog_conf(tmp_path, [NODE, "n2"], tmp_path / "cache", active=["5", "6", "7"])
    os.makedirs(tmp_path / "cache")
    cache_dir = tmp_path / "cache" / NODE
    typo = datasets[0] + "-v2"
    cases = {
        5: f"shardtool:{typo}",  # no dataset at the URL
        6: 'shardtool:{{"url": "{}", "mesh": "pp=3,dp=1"}}'.format(datasets[0]),  # 3 stages over 2 nodes x 1 rank
        7: 'shardtool:{{"url": "{}", "meshh": "dp=2"}}'.format(datasets[0]),
    }  # a typo in the request
    for job, comment in cases.items():
        res = run_prolog(conf, NODE, job_id=str(job), nodelist="n[1-2]", num_nodes=2, comment=comment)
        assert res.returncode == 0, res.stderr
        rec = read_job_record(str(cache_dir), job)
        assert rec["status"] == "usage_error" and rec["severity"] == "error", rec
    assert "no dataset at" in read_job_record(str(cache_dir), 5)["finding"]
    assert "unknown request key(s) 'meshh'" in read_job_record(str(cache_dir), 7)["finding"]
    out = train(typo, cache_dir, 5)
    assert out.returncode == 1 and "StagingError: the SLURM prolog could not stage" in out.stdout, out
    assert "no dataset at" in out.stdout and f"{cache_dir}/jobs/5.json" in out.stdout
    out = train(datasets[0], cache_dir, 6)
    assert out.returncode == 1 and "StagingError" in out.stdout and "pp=3" in out.stdout, out
    out = train(datasets[0], cache_dir, 7)
    assert out.returncode == 1 and "meshh" in out.stdout, out
    # another job, with no finding, on the same node is not affected
    assert train(datasets[0], cache_dir, 8).returncode == 0


@pytest.mark.timeout(180)
def test_source_moved_away_next_job_reads_the_node_cache(tmp_path, datasets):
    conf = prolog_conf(tmp_path, [NODE], tmp_path / "cache", active=["1", "2"])
    os.makedirs(tmp_path / "cache")
    cache_dir = tmp_path / "cache" / NODE
    url = datasets[1]
    res = stage(conf, 1, f"shardtool:{url}")
    assert res.returncode == 0 and read_job_record(str(cache_dir), 1)["status"] == "ok", res.stderr
    first = train(url, cache_dir, 1)
    assert first.returncode == 0, first
    shutil.move(url, url + ".moved")
    res = stage(conf, 2, f"shardtool:{url}")
    assert res.returncode == 0, res.stderr
    rec = read_job_record(str(cache_dir), 2)
    assert rec["status"] == "cached" and rec["severity"] == "warning" and "has no manifest any more" in rec["finding"]
    out = train(url, cache_dir, 2)
    assert out.returncode == 0 and out.stdout.split()[-1] == first.stdout.split()[-1], out
    assert "SLURM prolog for job 2" in out.stderr and "has no manifest any more" in out.stderr
    # a node whose cache lacks a shard is not complete: the job's mistake (or a moved dataset) stays one
    ds_shard = next(p for p in (cache_dir.rglob("*.tar")))
    os.unlink(ds_shard)
    res = stage(conf, 3, f"shardtool:{url}")
    assert res.returncode == 0 and read_job_record(str(cache_dir), 3)["status"] == "usage_error"


@pytest.mark.timeout(180)
def test_budget_evicts_a_version_no_running_job_asked_for_first(tmp_path, datasets):
    a, b, c = datasets
    budget = total_bytes(b) + total_bytes(c) + 4096  # two datasets fit, not three
    assert budget < total_bytes(a) + total_bytes(b) + total_bytes(c)
    cache_dir = tmp_path / "cache" / NODE
    os.makedirs(tmp_path / "cache")
    conf = prolog_conf(tmp_path, [NODE], tmp_path / "cache", active=["1", "2"], MAX_BYTES=budget)
    assert stage(conf, 1, f"shardtool:{a}").returncode == 0
    assert stage(conf, 2, f"shardtool:{b}").returncode == 0
    # job 1 ran last (its shards are the most recently used), then ended; job 2 still runs
    dc = open_cache(a, str(cache_dir))
    for i in range(4):
        with dc.reading(i):
            pass
    conf = prolog_conf(tmp_path, [NODE], tmp_path / "cache", active=["2", "3"], MAX_BYTES=budget)
    res = stage(conf, 3, f"shardtool:{c}")
    assert res.returncode == 0, res.stderr
    report = json.load(open(tmp_path / "cache" / f"{NODE}.warm-3.json"))
    assert report["status"] == "ok" and report["evicted_shards"] >= 1, report
    assert cached_shards(cache_dir, b) == {0, 1, 2, 3}  # the running job's version: untouched
    assert cached_shards(cache_dir, c) == {0, 1, 2, 3}
    assert cached_shards(cache_dir, a) != {0, 1, 2, 3}  # the finished job's, although more recently used
    assert read_job_record(str(cache_dir), 1) is None  # the finished job's record is gone
    assert read_job_record(str(cache_dir), 2) is not None


@pytest.mark.timeout(180)
def test_budget_never_evicts_a_shard_being_read_and_too_small_a_budget_is_the_nodes(tmp_path, datasets):
    a, b, _ = datasets
    cache_dir = tmp_path / "cache" / NODE
    os.makedirs(tmp_path / "cache")
    budget = total_bytes(b) + 4096
    conf = prolog_conf(tmp_path, [NODE], tmp_path / "cache", active=["2"], MAX_BYTES=10 * budget)
    assert stage(conf, 1, f"shardtool:{a}").returncode == 0
    dc = open_cache(a, str(cache_dir))
    with dc.reading(2):  # a rank of job 1 still reads shard 2 (job 1 no longer listed: its version is idle)
        conf = prolog_conf(tmp_path, [NODE], tmp_path / "cache", active=["2"], MAX_BYTES=budget)
        res = stage(conf, 2, f"shardtool:{b}")
    # shard 2 could not go, so b does not fit: the budget is below this node's share, a node fault
    assert res.returncode == 3, res.stderr
    assert 2 in cached_shards(cache_dir, a)
    assert read_job_record(str(cache_dir), 2)["status"] == "local_fault"
    # the job itself may ask for best effort: what fits is staged, exit 0, a warning for the job
    res = stage(conf, 4, 'shardtool:{{"url": "{}", "best_effort": true}}'.format(b))
    assert res.returncode == 0 and read_job_record(str(cache_dir), 4)["status"] in ("ok", "partial"), res.stderr


@pytest.mark.timeout(180)
def test_a_mixture_request_stages_every_source_and_names_the_one_missing(tmp_path, datasets):
    from shardtool.cache.jobs import StagingError, check_job_finding

    conf = prolog_conf(tmp_path, [NODE], tmp_path / "cache", active=["1", "2"])
    os.makedirs(tmp_path / "cache")
    cache_dir = tmp_path / "cache" / NODE
    exp = tmp_path / "exp"
    exp.mkdir()
    good = {"a": {"url": datasets[0], "weight": 0.5}, "b": {"url": datasets[1], "weight": 0.5}}
    (exp / "mix.json").write_text(json.dumps({"sources": good}))
    res = stage(conf, 1, "shardtool:mix.json", workdir=str(exp))  # relative to the job's directory
    assert res.returncode == 0, res.stderr
    rec = read_job_record(str(cache_dir), 1)
    assert rec["status"] == "ok" and len(rec["sources"]) == 2 and all(s["version"] for s in rec["sources"]), rec
    for url in datasets[:2]:
        assert cached_shards(cache_dir, url) == {0, 1, 2, 3}
    bad = {**good, "c": {"url": datasets[2] + "-typo", "weight": 0.5}}
    (exp / "mix2.json").write_text(json.dumps({"sources": bad}))
    res = stage(conf, 2, "shardtool:mix2.json", workdir=str(exp))
    assert res.returncode == 0, res.stderr
    rec = read_job_record(str(cache_dir), 2)
    assert rec["status"] == "usage_error" and [s["status"] for s in rec["sources"]] == ["ok", "ok", "usage_error"]
    env = {"SLURM_JOB_ID": "2"}
    check_job_finding(str(cache_dir), datasets[0], env)  # a source that was staged: nothing to say
    with pytest.raises(StagingError, match="no dataset at"):
        check_job_finding(str(cache_dir), datasets[2] + "-typo", env)


@pytest.mark.timeout(180)
def test_a_job_caps_what_it_holds_in_the_node_cache(tmp_path, datasets):
    conf = prolog_conf(tmp_path, [NODE], tmp_path / "cache", active=["1"])
    os.makedirs(tmp_path / "cache")
    cache_dir = tmp_path / "cache" / NODE
    url = datasets[0]
    shard = open_dataset(url).manifest.shards[0].bytes
    res = stage(conf, 1, "shardtool:" + json.dumps({"url": url, "max_bytes": 2 * shard + 100}))
    assert res.returncode == 0, res.stderr
    rec = read_job_record(str(cache_dir), 1)
    assert rec["status"] == "partial" and rec["severity"] == "warning" and "caps its staged shards" in rec["finding"]
    assert len(cached_shards(cache_dir, url)) == 2
    out = train(url, cache_dir, 1)  # the rest is fetched on demand, with the prolog's note
    assert out.returncode == 0 and "caps its staged shards" in out.stderr, out


@pytest.mark.timeout(120)
def test_epilog_forgets_the_jobs_record(tmp_path, datasets):
    from helpers.prolog import REPO

    conf = prolog_conf(tmp_path, [NODE], tmp_path / "cache", active=["9"])
    os.makedirs(tmp_path / "cache")
    assert stage(conf, 9, f"shardtool:{datasets[0]}").returncode == 0
    assert read_job_record(str(tmp_path / "cache" / NODE), 9) is not None
    env = {"SLURM_JOB_ID": "9", "SLURMD_NODENAME": NODE, "SHARDTOOL_WARM_CONF": conf}
    res = subprocess.run(
        ["/bin/bash", os.path.join(REPO, "examples", "slurm", "epilog.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 0, res.stderr
    assert read_job_record(str(tmp_path / "cache" / NODE), 9) is None
    assert not (tmp_path / "cache" / f"{NODE}.warm-9.json").exists()
    assert cached_shards(tmp_path / "cache" / NODE, datasets[0]) == {0, 1, 2, 3}  # the data stays


@pytest.mark.timeout(120)
def test_finished_jobs_records_and_reports_go_running_ones_stay(tmp_path, datasets):
    cache_root = tmp_path / "cache"
    os.makedirs(cache_root)
    conf = prolog_conf(tmp_path, [NODE], cache_root, active=["1", "2"])
    for job in (1, 2):
        assert stage(conf, job, f"shardtool:{datasets[0]}").returncode == 0
    conf = prolog_conf(tmp_path, [NODE], cache_root, active=["2", "3"])
    assert stage(conf, 3, f"shardtool:{datasets[1]}").returncode == 0
    assert sorted(os.listdir(cache_root / NODE / "jobs")) == ["2.json", "3.json"]
    assert sorted(p.name for p in cache_root.glob("*.warm-*.json")) == [f"{NODE}.warm-2.json", f"{NODE}.warm-3.json"]
    conf = prolog_conf(tmp_path, [NODE], cache_root, active=None)  # squeue cannot answer: nothing is dropped
    assert stage(conf, 4, f"shardtool:{datasets[1]}").returncode == 0
    assert sorted(os.listdir(cache_root / NODE / "jobs")) == ["2.json", "3.json", "4.json"]
