"""Packing: every sample exactly once with identical bytes, determinism, interop, job arrays."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardtool
from helpers.data_gen import (
    dir_digest,
    image_samples,
    read_all,
    tar_of_samples,
    token_records,
    write_jsonl,
    write_parquet,
    write_tree,
)
from shardtool.pack import merge
from shardtool.pack.units import split_contiguous

records_st = st.lists(
    st.fixed_dictionaries(
        {
            "tokens": st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=40),
            "text": st.text(max_size=30),
            "label": st.integers(-(2**40), 2**40),
        }
    ),
    min_size=1,
    max_size=60,
)
SETTINGS = settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))


def _pack_all_tasks(src, out, T, **kw):
    for i in range(T):
        shardtool.pack(src, out, num_tasks=T, task_index=i, env={}, **kw)
    if T > 1:
        merge(out)


@pytest.mark.timeout(240)
@SETTINGS
@given(
    records=records_st,
    fmt=st.sampled_from(["tar", "arrow"]),
    source=st.sampled_from(["jsonl", "parquet"]),
    workers=st.sampled_from([1, 2]),
    tasks=st.sampled_from([1, 3]),
    per_shard=st.integers(1, 25),
)
def test_every_sample_exactly_once(tmp_path_factory, records, fmt, source, workers, tasks, per_shard):
    tmp = tmp_path_factory.mktemp("p")
    src = (
        write_jsonl(str(tmp / "in.jsonl"), records)
        if source == "jsonl"
        else write_parquet(str(tmp / "in.parquet"), records, row_group_size=7)
    )
    out = str(tmp / "out")
    _pack_all_tasks(src, out, tasks, format=fmt, workers=workers, samples_per_shard=per_shard, length="tokens")
    got = read_all(out)
    assert sorted(got) == [f"{i:09d}" for i in range(len(records))]
    ds = shardtool.open_dataset(out)
    assert ds.lengths.tolist() == [len(r["tokens"]) for r in records]  # input order, whatever the split
    for i, r in enumerate(records):
        s = got[f"{i:09d}"]
        assert s["tokens"].tolist() == r["tokens"]
        assert s["tokens"].dtype == (np.int64 if source == "jsonl" else np.int32)
        assert s["text"] == r["text"] and s["label"] == r["label"]


def test_split_contiguous_is_a_partition():
    for w in ([], [1], [5, 1, 1, 1, 9, 2], list(range(1, 40))):
        for parts in (1, 2, 3, 7):
            r = split_contiguous(w, parts)
            assert len(r) == parts and r[0][0] == 0 and r[-1][1] == len(w)
            assert all(a[1] == b[0] for a, b in zip(r, r[1:]))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["tar", "arrow"])
@pytest.mark.parametrize("workers,tasks", [(1, 1), (2, 1), (2, 2)])
def test_deterministic_bytes(tmp_path, fmt, workers, tasks):
    src = write_jsonl(str(tmp_path / "in.jsonl"), token_records(300))
    digests = []
    for run in range(2):
        out = str(tmp_path / f"out{run}")
        _pack_all_tasks(src, out, tasks, format=fmt, workers=workers, samples_per_shard=40, length="tokens")
        d = dir_digest(out)
        assert not [p for p in d if ".tmp-" in p]
        digests.append(d)
    assert digests[0] == digests[1]
    assert json.loads(digests[0]["index.json"])["num_samples"] == 300


@pytest.mark.timeout(120)
def test_webdataset_reads_tar_shards_unmodified(tmp_path):
    import webdataset as wds

    samples = image_samples(40)
    tree = write_tree(str(tmp_path / "tree"), samples)
    out = str(tmp_path / "out")
    shardtool.pack(tree, out, samples_per_shard=15)
    ds = shardtool.open_dataset(out)
    urls = [os.path.join(out, s.path) for s in ds.manifest.shards]
    seen = {}
    for smp in wds.WebDataset(urls, shardshuffle=False):
        seen[smp["__key__"]] = {k: v for k, v in smp.items() if not k.startswith("__")}
    assert seen == samples

    # and for structured sources, the default decoders give back the original values
    recs = token_records(20)
    out2 = str(tmp_path / "out2")
    shardtool.pack(write_jsonl(str(tmp_path / "t.jsonl"), recs), out2)
    urls = [os.path.join(out2, s.path) for s in shardtool.open_dataset(out2).manifest.shards]
    got = sorted(wds.WebDataset(urls, shardshuffle=False).decode(), key=lambda s: s["__key__"])
    assert [g["tokens.npy"].tolist() for g in got] == [r["tokens"] for r in recs]
    assert [g["text"] for g in got] == [r["text"] for r in recs]
    assert [g["label.cls"] for g in got] == [r["label"] for r in recs]


@pytest.mark.timeout(120)
def test_tree_subdirs_tar_reshard_and_compressed_jsonl(tmp_path):
    samples = image_samples(30)
    tree = write_tree(str(tmp_path / "tree"), samples, subdirs=3)
    out = str(tmp_path / "o1")
    shardtool.pack(tree, out)
    got = read_all(out)
    assert len(got) == 30 and all("__" in k for k in got)

    tar = tar_of_samples(str(tmp_path / "in.tar"), samples)
    out = str(tmp_path / "o2")
    shardtool.pack(tar, out, format="arrow", samples_per_shard=7)
    assert read_all(out, decode=False) == samples

    recs = token_records(50)
    for comp in ("gz", "zst"):
        src = write_jsonl(str(tmp_path / f"in.jsonl.{comp}"), recs, compress=comp)
        out = str(tmp_path / f"o-{comp}")
        shardtool.pack(src, out, key="text" if comp == "gz" else None, length="tokens")
        got = read_all(out)
        assert len(got) == 50
        if comp == "gz":
            assert got["doc 7"]["tokens"].tolist() == recs[7]["tokens"]


@pytest.mark.timeout(120)
def test_key_field_and_length_fn(tmp_path):
    recs = [{"id": f"s{i}", "tokens": list(range(i + 1))} for i in range(10)]
    src = write_jsonl(str(tmp_path / "in.jsonl"), recs)
    out = str(tmp_path / "o")
    shardtool.pack(src, out, key="id", length_fn="helpers.tests_length_fn:double_tokens")
    ds = shardtool.open_dataset(out)
    assert ds.lengths.tolist() == [2 * (i + 1) for i in range(10)]
    assert ds.manifest.length["fn"] == "helpers.tests_length_fn:double_tokens"
    assert sorted(read_all(out)) == sorted(r["id"] for r in recs)


def test_merge_refuses_tasks_that_found_other_sources(tmp_path):
    """A glob that matched another set of files in one task: the merge published a dataset
    missing one file's samples, with no error."""
    for i in range(4):
        write_parquet(str(tmp_path / f"part{i}.parquet"), token_records(40, seed=i))
    pattern, out = str(tmp_path / "part*.parquet"), str(tmp_path / "o")
    shardtool.pack(pattern, out, num_tasks=2, task_index=0, env={})
    os.rename(tmp_path / "part1.parquet", tmp_path / "held")
    shardtool.pack(pattern, out, num_tasks=2, task_index=1, env={})
    os.rename(tmp_path / "held", tmp_path / "part1.parquet")
    with pytest.raises(
        shardtool.ShardtoolError, match=r"task 1 found other inputs than task 0: 3 sources .* against 4 sources"
    ):
        merge(out)
    assert not os.path.exists(os.path.join(out, "index.json"))
    shardtool.pack(pattern, out, num_tasks=2, task_index=1, env={})  # rerun with the same sources
    merge(out)
    assert len(read_all(out)) == 160


@pytest.mark.timeout(120)
def test_job_array_merge_refuses_missing_task_and_cli_inspect(tmp_path):
    import subprocess
    import sys

    src = write_parquet(str(tmp_path / "in.parquet"), token_records(100), row_group_size=10)
    out = str(tmp_path / "o")
    # --array=1-3: SLURM task id 2 is place 1. The missing ones are named as the user submitted
    # them (ids 1 and 3, not places 0 and 2), with the rerun that gives each its place.
    env = {"SLURM_ARRAY_TASK_COUNT": "3", "SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_MIN": "1"}
    done = shardtool.pack(src, out, env=env, length="tokens", samples_per_shard=8, quiet=True)
    assert "task 1/3 (SLURM array task 2) fragment" in done.summary()
    with pytest.raises(shardtool.ShardtoolError) as e:
        merge(out)
    assert "tasks have not finished: SLURM array task ids 1,3 (places 0,2)" in str(e.value)
    assert "--array=1,3 ... --num-tasks 3 --task-index $((SLURM_ARRAY_TASK_ID - 1))" in str(e.value)
    os.unlink(os.path.join(out, done.fragment))  # places given by hand: named as places
    shardtool.pack(src, out, num_tasks=3, task_index=1, env={}, length="tokens", samples_per_shard=8, quiet=True)
    with pytest.raises(shardtool.ShardtoolError, match=r"not finished: places 0,2 \(from 0\); rerun each with"):
        merge(out)
    for i in (0, 2):
        shardtool.pack(src, out, num_tasks=3, task_index=i, env={}, length="tokens", samples_per_shard=8)
    merge(out)
    assert len(read_all(out)) == 100

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    penv = dict(os.environ, PYTHONPATH=root)
    p = subprocess.run(
        [sys.executable, "-m", "shardtool", "inspect", out, "--json"],
        env=penv,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    assert info["samples"] == 100 and info["length"]["summary"]["count"] == 100
    assert set(info["length"]["summary"]) >= {"min", "p50", "p90", "p99", "max", "total"}
    assert "tokens" in info["peek"]["sample"]
