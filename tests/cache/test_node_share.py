"""Metadata fetched once per node, not once per rank (issue 38 item 1; shardtool/format/nodeshare.py).

The ranks of one job on one node read the same manifest, summaries, lengths range and sample
indexes; the first to take a file's lock fetches it into /dev/shm and the others read the copy.
Counted for real: torchrun ranks reading an s3:// dataset (real stdlib text on moto) through the
counting proxy of tests/helpers/s3proxy.py, against the same job with sharing off."""

from __future__ import annotations

import json
import multiprocessing as mp
import os

import pytest

from helpers.runcli import shardtool_cli
from helpers.s3proxy import s3_proxy, stdlib_dataset  # noqa: F401  (fixture)
from helpers.s3server import s3_server  # noqa: F401  (fixture)
from helpers.skips import require
from helpers.torchrun import torchrun
from shardtool.format import nodeshare, open_dataset
from shardtool.format.manifest import MANIFEST_NAME
from shardtool.format.summaries import SUMMARIES_NAME

pytestmark = pytest.mark.timeout(300)
PREFIX = "share/ds"


def _reader(args):
    """One process of a simulated node: read ``key`` through the share, counting real reads."""
    key, env, counter, results, i = args
    os.environ.update(env)

    def read() -> bytes:
        with counter.get_lock():
            counter.value += 1
        return b"manifest bytes " * 1000

    results[i] = len(nodeshare.shared_read(key, read))


def _node(n: int, env: dict, key: str) -> tuple[int, list[int]]:
    ctx = mp.get_context("fork")
    counter, results = ctx.Value("i", 0), ctx.Array("i", n)
    procs = [ctx.Process(target=_reader, args=((key, env, counter, results, i),)) for i in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return counter.value, list(results)


def test_one_process_of_a_job_on_a_node_reads_the_others_share(tmp_path):
    require(os.access("/dev/shm", os.W_OK), "no writable /dev/shm here")
    job = {"SLURM_JOB_ID": f"t{os.getpid()}", "SLURM_STEP_ID": "0", nodeshare.SHARE_ENV: "1"}
    reads, sizes = _node(6, job, f"k-{tmp_path}")
    assert reads == 1 and sizes == [15000] * 6
    # Another job (another step) fetches for itself; sharing off, every process does.
    reads, _ = _node(3, {**job, "SLURM_STEP_ID": "1"}, f"k-{tmp_path}")
    assert reads == 1
    reads, _ = _node(3, {**job, nodeshare.SHARE_ENV: "0"}, f"k-{tmp_path}")
    assert reads == 3


def test_outside_a_job_or_where_dev_shm_fails_every_process_reads(monkeypatch, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")}
    assert nodeshare.job_identity(env) is None
    calls = []
    assert nodeshare.shared_read("k", lambda: calls.append(1) or b"x", env=env) == b"x"
    monkeypatch.setattr(nodeshare, "SHARE_ROOT", str(tmp_path / "file"))
    (tmp_path / "file").write_text("not a directory")
    job = {"SLURM_JOB_ID": "1", nodeshare.SHARE_ENV: "1"}
    assert nodeshare.shared_read("k", lambda: calls.append(1) or b"y", env=job) == b"y"
    assert len(calls) == 2


def test_a_failed_fetch_is_the_fetchers_and_the_next_rank_tries_itself(monkeypatch, tmp_path):
    monkeypatch.setattr(nodeshare, "SHARE_ROOT", str(tmp_path))
    job = {"SLURM_JOB_ID": "2", nodeshare.SHARE_ENV: "1"}

    def broken() -> bytes:
        raise FileNotFoundError("gone")

    with pytest.raises(FileNotFoundError):
        nodeshare.shared_read("k2", broken, env=job)
    assert nodeshare.shared_read("k2", lambda: b"now", env=job) == b"now"
    assert nodeshare.shared_read("k2", broken, env=job) == b"now"  # published: no fetch
    # Copies of a job untouched for a day are swept by the next job that publishes.
    old = tmp_path / f"shardtool-{os.getuid()}" / "slurm-old-0"
    old.mkdir(parents=True)
    os.utime(old, (1, 1))
    monkeypatch.setattr(nodeshare, "_swept", False)
    nodeshare.shared_read("k3", lambda: b"z", env={**job, "SLURM_JOB_ID": "3"})
    assert not old.exists()


@pytest.mark.parametrize("cache", [False, True], ids=["no-cache", "node-cache"])
def test_torchrun_ranks_of_one_node_fetch_the_metadata_once(tmp_path, s3_server, s3_proxy, cache):  # noqa: F811
    require(os.access("/dev/shm", os.W_OK), "no writable /dev/shm here")
    src = stdlib_dataset(str(tmp_path / "ds"), files=120)
    url = s3_server.upload(src, PREFIX)
    options = json.dumps(s3_proxy.storage_options)

    def job(share: str) -> tuple[dict, list]:
        out = tmp_path / f"out-{share}"
        out.mkdir()
        extra = ["--cache-dir", str(tmp_path / f"cache-{share}")] if cache else []
        s3_proxy.reset()
        res = torchrun(
            "node_share_worker.py",
            4,
            "--url",
            url,
            "--options",
            options,
            "--out",
            str(out),
            *extra,
            timeout=200,
            env={nodeshare.SHARE_ENV: share},
        )
        assert res.returncode == 0, res.stderr[-4000:]
        c = s3_proxy.counts()
        gets: dict[str, int] = {}
        for (k, kind), n in c.by_key_kind.items():
            if kind in ("GET", "RANGED_GET"):
                gets[k] = gets.get(k, 0) + n
        keys = [json.load(open(out / f"rank{r}.json")) for r in range(4)]
        return gets, keys

    shared, keys_shared = job("1")
    apart, keys_apart = job("0")
    assert keys_shared == keys_apart  # the same batches either way
    meta = (f"{PREFIX}/{MANIFEST_NAME}", f"{PREFIX}/{SUMMARIES_NAME}")
    print(
        f"\nper node of 4 ranks, reads of the manifest and summaries: shared {[shared.get(k) for k in meta]}, apart {[apart.get(k) for k in meta]}"
    )
    assert [shared.get(k) for k in meta] == [1, 1]  # once per node, not once per rank
    # Apart, each rank reads the manifest (and, without a node cache, which stores the rest under
    # its own locks, the summaries too).
    # (With a node cache, ranks that miss the stored copy at the same moment each fetch it: 1 to 4.)
    assert apart.get(meta[0]) == 4 and (1 <= apart.get(meta[1], 0) <= 4 if cache else apart.get(meta[1]) == 4)
    data = {f"{PREFIX}/{s.path}" for s in open_dataset(src).manifest.shards}
    indexes = {f"{PREFIX}/{s.index}" for s in open_dataset(src).manifest.shards}
    assert all(shared.get(k) == 1 for k in indexes), {k: shared.get(k) for k in indexes}
    if not cache:  # apart, a rank reads the index of each shard its own batches touch
        assert len(indexes) < sum(apart.get(k, 0) for k in indexes) <= 4 * len(indexes)
    if not cache:  # what `shardtool plan` predicts for this layout is what the node made
        res = shardtool_cli("plan", src, "--nodes", "1", "--ranks-per-node", "4", "--batch-size", "4", "--json")
        predicted = json.loads(res.stdout)["startup_requests"]
        assert sum(n for k, n in shared.items() if k not in data) == predicted["total"]
        assert sum(n for k, n in apart.items() if k not in data) <= predicted["without_sharing"]  # a bound
