"""Packing as a plan stage: rows planned per data group, equal counts, every token once, exact and
elastic resume — at the planner, and through the loader with workers."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.strategies import LAYOUTS, datasets
from shardtool.loader import ShardedLoader
from shardtool.plan import ArraySource, Batching, DataLayout, Layout, Planner
from shardtool.plan.packing import Packing
from shardtool.plan.simulate import simulate_epoch
from shardtool.plan.synthetic import lognormal_lengths
from test_loader_data import write_dataset

settings.register_profile("packing-stage", max_examples=40, deadline=None)
settings.load_profile("packing-stage")
DATASET = "manifest-sha-1234"


def token_counts(rows, size: int) -> np.ndarray:
    """How many tokens of each document the rows hold."""
    return np.bincount(rows.span_pos, weights=rows.span_len, minlength=size).astype(np.int64)


@st.composite
def packed_cases(draw):
    data = draw(datasets(min_size=300, max_size=2000))
    longest = max(int(data.lengths.max(initial=1)), 1)
    seq = draw(st.integers(max(8, longest // 4), 2 * longest + 8))
    packing = Packing(
        seq, draw(st.sampled_from(["concat", "best-fit", "no-split"])), eos_id=draw(st.one_of(st.none(), st.just(2)))
    )
    batching = Batching(
        batch_size=draw(st.integers(1, 6)), packing=packing, shuffle=draw(st.booleans()), seed=draw(st.integers(0, 99))
    )
    return data, draw(st.sampled_from(LAYOUTS)), batching, draw(st.integers(0, 50))


def _ranks(planner, state, layout):
    return [planner.rank_plan(state, d) for d in range(layout.dp_size)]


@given(packed_cases())
def test_every_token_once_an_epoch_except_the_reported_remainder(case):
    data, layout, batching, epoch = case
    source = ArraySource(data.lengths, data.shard_counts)
    planner = Planner(source, batching)
    dl = DataLayout.pure_dp(layout)
    try:
        state = planner.start(epoch, DATASET, dl)
    except ValueError as e:
        assert "too small" in str(e)
        return
    plans = _ranks(planner, state, dl)
    n = plans[0].batches_per_rank
    per = batching.batch_size
    assert all(p.batches_per_rank == n and p.rows.num_rows <= n * per for p in plans), "equal counts"
    assert all(int(np.diff(p.row_offsets).max(initial=0)) <= per for p in plans)
    served = sum(token_counts(p.rows, data.lengths.size) for p in plans)
    groups = [planner.group(dl, g, epoch) for g in range(dl.num_groups)]
    left = sum(token_counts(g.left_out, data.lengths.size) for g in groups)
    dropped = np.zeros(data.lengths.size, bool)
    for g in groups:
        dropped[g.rows.dropped] = True
        dropped[g.left_out.dropped] = True
    full = data.lengths + batching.packing.extra_tokens
    if batching.packing.policy == "no-split":
        assert np.array_equal(dropped, full > batching.packing.seq_len), "no-split drops exactly the long documents"
        full = np.where(dropped, 0, full)
    assert np.array_equal(served + left, full), "every token exactly once, or in the reported remainder"
    for p in plans:  # rows are exactly seq_len and within the budget of pieces
        assert (p.rows.row_tokens() <= batching.packing.seq_len).all()
        assert (np.diff(p.rows.row_offsets) <= batching.packing.max_docs_per_row).all()


@given(packed_cases(), st.sampled_from(LAYOUTS), st.floats(0, 1))
def test_elastic_resume_of_packed_rows_repeats_no_token(case, new, where):
    data, layout, batching, epoch = case
    planner = Planner(ArraySource(data.lengths, data.shard_counts), batching)
    dl, new_dl = DataLayout.pure_dp(layout), DataLayout.pure_dp(new)
    try:
        state = planner.start(epoch, DATASET, dl)
    except ValueError:
        return
    k = int(where * state.last.batches)
    before = _ranks(planner, state, dl)
    served = sum(token_counts(p.rows.take(np.arange(p.row_offsets[k])), data.lengths.size) for p in before)
    resumed = planner.continue_on(state.with_served(k), new_dl)
    after = _ranks(planner, resumed, new_dl)
    start = resumed.last.served
    assert len({p.batches_per_rank for p in after}) == 1
    for p in after:
        served = served + token_counts(p.rows.take(np.arange(p.row_offsets[start], p.rows.num_rows)), data.lengths.size)
    assert (served <= data.lengths + batching.packing.extra_tokens).all(), "no token served twice"


def test_fill_rate_and_remainder_on_the_lognormal_corpus():
    source = ArraySource(lognormal_lengths(100_000, seed=4), np.full(10, 10_000))
    for policy in ("best-fit", "concat"):
        sim = simulate_epoch(
            source, DataLayout.pure_dp(Layout(2, 2)), Batching(batch_size=8, packing=Packing(8192, policy)), 0
        )
        assert sim.fill_rate >= 0.995 and sim.remainder_tokens_fraction <= 0.01, (policy, sim.fill_rate)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    lengths = lognormal_lengths(2400, seed=5, median=60, high=700)
    root, keys = write_dataset(str(tmp_path_factory.mktemp("packed") / "ds"), [600] * 4, lengths=lengths, extra=False)
    return root, keys, lengths


def _rows_of(batches):
    """(keys per row, tokens per row) of a run of packed batches, for comparing runs."""
    return [
        (
            tuple(tuple(r) for r in b["__key__"]),
            b["input_ids"].tolist(),
            b["labels"].tolist(),
            b["position_ids"].tolist(),
            b["cu_seqlens"].tolist(),
        )
        for b in batches
    ]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("workers", [(0, 0), (0, 2), (2, 0)])
def test_loader_resumes_packed_rows_exactly(corpus, workers):
    root, _, _ = corpus
    kw = dict(seq_len=256, batch_size=3, packing="best-fit", eos_id=1, world_size=2, ranks_per_node=2, seed=7)
    full = [_rows_of(ShardedLoader(root, rank=r, num_workers=0, **kw)) for r in range(2)]
    for cut in (0, 5, len(full[0]) - 1):
        states = []
        for r in range(2):
            ld = ShardedLoader(root, rank=r, num_workers=workers[0], **kw)
            it = iter(ld)
            for _ in range(cut):
                next(it)
            states.append(json.loads(json.dumps(ld.state_dict())))
            it.close()
        assert states[0] == states[1]
        for r in range(2):
            ld = ShardedLoader(root, rank=r, num_workers=workers[1], **kw)
            ld.load_state_dict(states[r])
            assert _rows_of(ld) == full[r][cut:]


@pytest.mark.timeout(240)
def test_loader_elastic_three_to_two_repeats_no_token(corpus):
    root, keys, lengths = corpus
    kw = dict(seq_len=256, batch_size=2, packing="concat", seed=3, num_workers=0)
    three = [ShardedLoader(root, rank=r, world_size=3, ranks_per_node=1, **kw) for r in range(3)]
    tokens = np.zeros(len(keys), np.int64)  # tokens served per document, from the batches delivered

    def add(batch):
        for row_keys, row_ids, labels in zip(batch["__key__"], batch["input_ids"].tolist(), batch["lengths"].tolist()):
            assert len(row_ids) == 256
        real = batch["lengths"].tolist()
        assert all(0 <= t <= 256 for t in real)
        return batch

    half = len(three[0]) // 2
    for ld in three:
        it = iter(ld)
        for i in range(half):
            add(next(it))
            rows = ld.plan.batch_rows(i)
            np.add.at(tokens, rows.span_pos, rows.span_len)
        it.close()
    state = three[0].state_dict()
    two = [ShardedLoader(root, rank=r, world_size=2, ranks_per_node=1, **kw) for r in range(2)]
    for ld in two:
        ld.load_state_dict(state)
        plan = ld.plan  # this segment's (after the pass the loader is in the next epoch)
        got = [add(b) for b in ld]
        assert len(got) == plan.batches_per_rank
        for i in range(plan.batches_per_rank):
            rows = plan.batch_rows(i)
            np.add.at(tokens, rows.span_pos, rows.span_len)
    assert (tokens <= lengths).all(), "no token served twice across the resize"


@pytest.mark.timeout(240)
def test_the_example_trains_on_packed_rows_under_torchrun(corpus, tmp_path):
    import os
    import subprocess
    import sys

    from helpers.s3server import free_port

    root, _, _ = corpus
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=repo, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_addr",
            "127.0.0.1",
            f"--master_port={free_port()}",
            os.path.join(repo, "examples", "train_ddp.py"),
            "--data",
            root,
            "--seq-len",
            "128",
            "--packing",
            "best-fit",
            "--eos-id",
            "1",
            "--batch-size",
            "4",
            "--max-steps",
            "6",
            "--num-workers",
            "1",
            "--log-dir",
            str(tmp_path),
            "--collective-timeout",
            "60",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    summaries = [json.loads((tmp_path / f"summary.rank{r}.json").read_text()) for r in range(2)]
    assert [s["steps"] for s in summaries] == [6, 6]
    losses = [json.loads(line)["loss"] for line in (tmp_path / "keys.rank0.jsonl").read_text().splitlines()]
    assert all(np.isfinite(losses)) and len(losses) == 6
