"""Exact evaluation (``ShardedLoader(exact=True)``): every sample of the dataset served once in
total on any number of ranks, equal batch counts, padding marked in ``batch["valid"]``, and a
per-sample metric reduced over the valid entries equal to one process's.

The data is issue 35's shape: 1,003 real documents as byte ids, 617 stdlib files longer than
1,024 bytes and 386 short /usr/share/doc files, in 5 shards."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import shardtool
from helpers.exact_eval_worker import sample_metric
from helpers.realtext import byte_ids, doc_files, stdlib_files
from helpers.runcli import shardtool_cli
from helpers.skips import require
from helpers.torchrun import torchrun
from shardtool.loader import LoaderError, ShardedLoader, ValidSum


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(url, {key: byte ids}) of 1,003 real documents."""
    long = [p for p in stdlib_files() if os.path.getsize(p) > 1024][:617]
    short = [p for p in doc_files() if 0 < os.path.getsize(p) <= 1024][:386]
    require(len(long) == 617 and len(short) == 386, "too few stdlib files or /usr/share/doc files here")
    paths = [p for _, p in sorted(enumerate(long + short), key=lambda t: (t[0] * 7919) % 1003)]
    docs = [byte_ids(p) for p in paths]
    root = str(tmp_path_factory.mktemp("exact") / "ds")
    total = sum(d.nbytes for d in docs)
    shardtool.pack(
        [{"tokens": d, "path": p} for d, p in zip(docs, paths)],
        root,
        format="tar",
        length="tokens",
        shard_size=total // 4,
    )
    ds = shardtool.open(root)
    got = {ds[i]["__key__"]: np.asarray(ds[i]["tokens"]) for i in range(len(ds))}
    assert len(got) == 1003 and len(ds.manifest.shards) >= 4
    return root, got


def _reference(docs: dict) -> float:
    """The metric over every document, as one process without a loader computes it."""
    return float(sum(int(d.astype(np.int64).sum()) + 1000 * d.size + 1 for d in docs.values()))


def _ranks(url: str, world: int, **kw) -> list[ShardedLoader]:
    return [
        ShardedLoader(url, rank=r, world_size=world, ranks_per_node=1, exact=True, pin_memory=False, **kw)
        for r in range(world)
    ]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("batch_size, workers", [(8, 0), (1, 2), (3, 0)])
def test_bucketed_serves_every_sample_once_and_marks_padding(corpus, world, batch_size, workers):
    url, docs = corpus
    loaders = _ranks(url, world, batch_size=batch_size, shuffle=False, num_workers=workers)
    counts = {len(ld) for ld in loaders}
    assert len(counts) == 1  # equal batch counts: DDP never waits on a rank without one
    keys, total, padding = [], 0.0, 0
    for ld in loaders:
        metric, batches = ValidSum(), 0
        for batch in ld:
            valid = batch["valid"]
            assert valid.dtype == torch.bool and valid.shape == (len(batch["__key__"]),)
            assert valid.all() or not valid.any()  # a batch is real, or one padding sample
            padding += int((~valid).sum())
            keys += [k for k, ok in zip(batch["__key__"], valid.tolist()) if ok]
            metric.add(sample_metric(batch), valid)
            batches += 1
        assert batches == len(ld)
        total += metric.reduce()[0]
    assert sorted(keys) == sorted(docs)  # each sample exactly once, none repeated as a real one
    assert total == _reference(docs)
    if batch_size == 1 and world in (2, 3, 8):
        assert padding > 0  # 1,003 one-sample batches do not divide over these ranks: padded


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("seq_len, rows, workers, outputs", [(1024, 4, 0, "full"), (256, 2, 2, "lean")])
def test_packed_serves_every_token_once_and_marks_padding_rows(corpus, world, seq_len, rows, workers, outputs):
    url, docs = corpus
    loaders = _ranks(
        url, world, batch_size=rows, seq_len=seq_len, shuffle=False, num_workers=workers, packed_outputs=outputs
    )
    assert len({len(ld) for ld in loaders}) == 1
    want = sum(int(d.astype(np.int64).sum()) + d.size for d in docs.values())
    tokens, total = 0, 0.0
    for ld in loaders:
        metric = ValidSum()
        for batch in ld:
            valid, lengths = batch["valid"], batch["lengths"]
            assert valid.shape == (rows,) and torch.equal(valid, lengths > 0)
            ids = batch["input_ids"].long().reshape(rows, seq_len)
            inside = torch.arange(seq_len)[None, :] < lengths[:, None]
            metric.add(((ids + 1) * inside).sum(dim=1).double(), valid)
            tokens += int(lengths[valid].sum())
        total += metric.reduce()[0]
    assert tokens == sum(d.size for d in docs.values())  # every token once
    assert total == want


def test_exact_padding_is_cheap_where_batches_divide(corpus):
    url, _ = corpus
    (ld,) = _ranks(url, 1, batch_size=8, num_workers=0)
    assert len(ld) == -(-1003 // 8)  # one window sorted by length: the fewest batches
    # One node of 8 ranks is one data group: its 126 batches dealt, 2 of them padding.
    node = ShardedLoader(url, batch_size=8, exact=True, rank=0, world_size=8, ranks_per_node=8, num_workers=0)
    assert len(node) == -(-126 // 8)


def test_exact_is_refused_with_what_it_cannot_keep(corpus):
    url, _ = corpus
    with pytest.raises(ValueError, match="drop_last=True"):
        ShardedLoader(url, batch_size=4, exact=True, drop_last=True)
    with pytest.raises(ValueError, match="shuffle_block"):
        ShardedLoader(url, batch_size=4, exact=True, shuffle_block=64)
    with pytest.raises(ValueError, match="changes? every epoch"):
        ShardedLoader(url, max_tokens=200_000, exact=True, bucketing=False)
    with pytest.raises(LoaderError, match="return a dict"):
        (ld,) = _ranks(url, 1, batch_size=4, num_workers=0, collate_fn=lambda samples: [s["__key__"] for s in samples])
        next(iter(ld))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_exact_resume_on_another_world_size_still_serves_each_sample_once(corpus, world):
    url, docs = corpus
    first = _ranks(url, 3, batch_size=5, num_workers=0)
    keys = []
    for ld in first:
        it = iter(ld)
        for _ in range(17):
            batch = next(it)
            keys += [k for k, ok in zip(batch["__key__"], batch["valid"].tolist()) if ok]
    state = first[0].state_dict()
    resumed = _ranks(url, world, batch_size=5, num_workers=0)
    for ld in resumed:
        ld.load_state_dict(state)
    assert len({ld.batches_left for ld in resumed}) == 1
    for ld in resumed:
        for batch in ld:
            keys += [k for k, ok in zip(batch["__key__"], batch["valid"].tolist()) if ok]
    assert sorted(keys) == sorted(docs)


@pytest.mark.timeout(240)
def test_torchrun_three_ranks_reduce_to_the_single_process_metric(corpus, tmp_path):
    url, docs = corpus
    out = str(tmp_path / "out")
    os.makedirs(out)
    res = torchrun("exact_eval_worker.py", 3, "--data", url, "--out", out, "--batch-size", "2", timeout=200)
    assert res.returncode == 0, res.stderr[-4000:]
    recs = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(3)]
    assert len({(r["len"], r["batches"]) for r in recs}) == 1
    assert sorted(k for r in recs for k in r["keys"]) == sorted(docs)
    assert all(r["sum"] == _reference(docs) and r["count"] == 1003 for r in recs)


def test_plan_and_trace_show_the_padding(corpus):
    url, _ = corpus
    layout = ["--batch-size", "1", "--nodes", "3", "--ranks-per-node", "1", "--no-shuffle"]
    res = shardtool_cli("plan", url, *layout, "--exact", "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    loaders = _ranks(url, 3, batch_size=1, shuffle=False, num_workers=0)
    pads = sum(int(ld.plan.pad.sum()) for ld in loaders)
    assert report["padding_batches"] == pads > 0 and report["remainder_samples"] == 0
    assert report["batches_per_rank"] == len(loaders[0])
    # The trace of a rank's last step says which of its samples is padding, as the batch does.
    rank = next(r for r, ld in enumerate(loaders) if ld.plan.pad[-1])
    res = shardtool_cli(
        "trace", url, *layout, "--exact", "--step", str(len(loaders[0]) - 1), "--rank", str(rank), "--json"
    )
    assert res.returncode == 0, res.stderr
    assert [s["valid"] for s in json.loads(res.stdout)["samples"]] == [False]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [3, 8])
@pytest.mark.parametrize("shuffle", [False, True], ids=["in-order", "bucketed"])
def test_a_token_budget_serves_every_sample_once(corpus, world, shuffle):
    url, docs = corpus
    budget = 2 * max(d.size for d in docs.values())  # the longest file alone, or two
    loaders = _ranks(url, world, max_tokens=budget, shuffle=shuffle, num_workers=0)
    assert len({len(ld) for ld in loaders}) == 1
    keys, total = [], 0.0
    for ld in loaders:
        metric = ValidSum()
        for batch in ld:
            assert int(batch["lengths"].max()) * len(batch["__key__"]) <= budget
            keys += [k for k, ok in zip(batch["__key__"], batch["valid"].tolist()) if ok]
            metric.add(sample_metric(batch), batch["valid"])
        total += metric.reduce()[0]
    assert sorted(keys) == sorted(docs) and total == _reference(docs)
