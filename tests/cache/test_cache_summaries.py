"""A damaged ``summaries.arrow`` in a node cache. It is not in the manifest by hash, so nothing
checked it: `cache verify` said all was well, a second warm skipped it, and the loader planned
from summaries computed from the lengths (no weight sketch), cutting other ranges than the
other nodes: two nodes of a 2-node torchrun job read 2 samples each an epoch, with no error.
Now the warm and the loader fetch it again where the source is there, `cache verify` finds it,
and where it cannot be repaired (the source gone) the ranks' agreement check refuses to train.
Real data: stdlib files as byte ids, two nodes of one rank."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import shardtool
from helpers.forkranks import free_port
from helpers.realtext import byte_ids, stdlib_files
from helpers.runcli import repo_env, shardtool_cli
from shardtool.cache import warm
from shardtool.plan import Layout, Placement

pytestmark = pytest.mark.timeout(240)


@pytest.fixture()
def dataset(tmp_path) -> str:
    root = str(tmp_path / "ds")
    rows = [{"tokens": byte_ids(p).astype(np.uint16)} for p in stdlib_files(160)]
    shardtool.pack(rows, root, length="tokens", shard_size=1_000_000, format="arrow")
    return root


def _warm(url: str, cache: str, node: int) -> None:
    warm(url, cache, placement=Placement(Layout(2, 1), node), progress=False)


def _damage(cache: str) -> str:
    (version,) = [d for d in os.listdir(cache) if d.startswith("xxh3")]
    path = os.path.join(cache, version, "summaries.arrow")
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2 : len(data) // 2 + 4] = b"XXXX"
    open(path, "wb").write(bytes(data))
    return path


def _keys(url: str, cache: str, node: int) -> list[str]:
    from shardtool.loader import ShardedLoader

    ld = ShardedLoader(url, seq_len=512, batch_size=2, rank=node, world_size=2, ranks_per_node=1, cache_dir=cache)
    keys = [k for b in ld for k in b["__key__"]]
    ld.close()
    return keys


def test_warm_verify_and_the_loader_repair_a_damaged_summaries_file(dataset, tmp_path):
    good = open(os.path.join(dataset, "summaries.arrow"), "rb").read()
    cache = str(tmp_path / "cache")
    _warm(dataset, cache, 0)
    want = _keys(dataset, cache, 0)
    path = _damage(cache)
    _warm(dataset, cache, 0)  # a second warm fetches it again
    assert open(path, "rb").read() == good
    _damage(cache)
    assert _keys(dataset, cache, 0) == want  # the loader too, and plans as before
    assert open(path, "rb").read() == good
    _damage(cache)
    p = shardtool_cli("cache", "verify", "--cache-dir", cache)
    assert p.returncode == 1 and "1 bad metadata" in p.stdout and "summaries.arrow (removed)" in p.stdout + p.stderr


RANK = """
import os, sys, torch.distributed as dist
from shardtool.loader import ShardedLoader
url, cache = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
ld = ShardedLoader(url, seq_len=512, batch_size=2, rank=dist.get_rank(), world_size=2, ranks_per_node=1, cache_dir=cache)
try:
    next(iter(ld))
    print("TRAINED")
except Exception as e:
    print("REFUSED", e)
"""


def test_ranks_that_plan_from_other_summaries_refuse_to_train(dataset, tmp_path):
    caches = [str(tmp_path / f"node{n}") for n in (0, 1)]
    for n, cache in enumerate(caches):
        _warm(dataset, cache, n)
    _damage(caches[0])
    away = dataset + ".away"
    os.rename(dataset, away)  # offline: node 0 cannot fetch it again, and falls back
    env = dict(repo_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, dataset, caches[r]],
            env=dict(env, RANK=str(r), LOCAL_RANK="0"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    out = [p.communicate(timeout=180) for p in procs]
    for stdout, stderr in out:
        assert "REFUSED" in stdout and "ranks disagree" in stdout and "summaries" in stdout, (stdout, stderr[-2000:])
    os.rename(away, dataset)
