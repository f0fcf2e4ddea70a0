"""The packing stage (shardtool.plan.packing): rows of seq_len tokens from one window's lengths."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardtool.plan.packing import Packing, Rows, default_max_docs, pack_rows, rows_estimate
from shardtool.plan.synthetic import lognormal_lengths


@st.composite
def windows(draw, policies=("concat", "best-fit", "no-split")):
    seq = draw(st.integers(1, 48))
    lengths = draw(st.lists(st.integers(0, 3 * seq + 2), max_size=120))
    eos = draw(st.sampled_from([None, 0, 7]))
    maxd = draw(st.sampled_from([None, 1, 2, 3, 1000]))
    policy = draw(st.sampled_from(policies))
    return np.asarray(lengths, dtype=np.int64), Packing(seq, policy, eos_id=eos, max_docs_per_row=maxd)


def sizes_of(lengths: np.ndarray, packing: Packing) -> np.ndarray:
    return lengths + packing.extra_tokens


def check_rows_shape(rows: Rows, packing: Packing) -> None:
    per_row = np.diff(rows.row_offsets)
    assert rows.row_offsets[0] == 0 and rows.row_offsets[-1] == len(rows.span_pos)
    assert (per_row >= 1).all() and (per_row <= packing.max_docs_per_row).all()
    assert (rows.span_len >= 1).all()
    assert (rows.row_tokens() <= packing.seq_len).all()
    for a in (rows.row_offsets, rows.span_pos, rows.span_start, rows.span_len, rows.dropped):
        assert a.dtype == np.int64


def pieces_by_doc(rows: Rows) -> dict[int, list[tuple[int, int]]]:
    out: dict[int, list[tuple[int, int]]] = {}
    for p, s, n in zip(rows.span_pos.tolist(), rows.span_start.tolist(), rows.span_len.tolist()):
        out.setdefault(p, []).append((s, n))
    return {p: sorted(v) for p, v in out.items()}


def check_each_token_once(rows: Rows, sizes: np.ndarray, skip: set[int] = frozenset()) -> None:
    """Every token of every (non-skipped, non-empty) document in exactly one span."""
    docs = pieces_by_doc(rows)
    expected = {i for i in np.flatnonzero(sizes > 0).tolist() if i not in skip}
    assert set(docs) == expected
    for p, pieces in docs.items():
        at = 0
        for s, n in pieces:
            assert s == at, f"document {p}: gap or overlap at token {at}: {pieces}"
            at += n
        assert at == sizes[p]


@settings(max_examples=300, deadline=None)
@given(windows())
def test_every_token_once_and_rows_within_bounds(case):
    lengths, packing = case
    rows = pack_rows(lengths, packing)
    sizes = sizes_of(lengths, packing)
    check_rows_shape(rows, packing)
    long = set(np.flatnonzero(sizes > packing.seq_len).tolist())
    if packing.policy == "no-split":
        assert rows.dropped.tolist() == sorted(long)
        assert rows.split_docs == 0
        check_each_token_once(rows, sizes, skip=long)
    else:
        assert rows.dropped.size == 0
        check_each_token_once(rows, sizes)
    assert rows.tokens == int(sizes.sum()) - int(sizes[sorted(long)].sum() if packing.policy == "no-split" else 0)
    split = sum(len(v) > 1 for v in pieces_by_doc(rows).values())
    assert rows.split_docs == split


@settings(max_examples=200, deadline=None)
@given(windows(policies=("concat",)))
def test_concat_is_the_window_cut_into_rows(case):
    lengths, packing = case
    rows = pack_rows(lengths, packing)
    sizes = sizes_of(lengths, packing)
    # Read row after row, the spans spell the window's documents in order, each continuing where it stopped.
    stream = [
        (p, s + i)
        for p, s, n in zip(rows.span_pos.tolist(), rows.span_start.tolist(), rows.span_len.tolist())
        for i in range(n)
    ]
    assert stream == [(p, i) for p in range(len(sizes)) for i in range(int(sizes[p]))]
    tokens = rows.row_tokens()
    per_row = np.diff(rows.row_offsets)
    # Only the last row, or a row closed by the piece bound, is short.
    short = np.flatnonzero(tokens[:-1] < packing.seq_len)
    assert (per_row[short] == packing.max_docs_per_row).all()
    if packing.max_docs_per_row >= packing.seq_len:
        assert rows.num_rows == -(-int(sizes.sum()) // packing.seq_len)
        assert rows.num_rows == rows_estimate(int(lengths.sum()), len(lengths), packing)


def replay_best_fit(rows: Rows, packing: Packing) -> None:
    """Replay the placements longest piece first: each must go to the open row with the least
    room that holds it (any of them on a tie), or open the next row when none does."""
    seq, maxd = packing.seq_len, packing.max_docs_per_row
    row_of = np.repeat(np.arange(rows.num_rows), np.diff(rows.row_offsets))
    order = np.lexsort((rows.span_start, rows.span_pos, -rows.span_len))
    room: list[int] = []
    count: list[int] = []
    for k in order.tolist():
        size, r = int(rows.span_len[k]), int(row_of[k])
        fitting = [room[j] for j in range(len(room)) if room[j] >= size and count[j] < maxd]
        if r == len(room):
            assert not fitting, f"piece of {size} opened row {r} though rows with room {fitting} were open"
            room.append(seq)
            count.append(0)
        else:
            assert r < len(room), "rows must be numbered in opening order"
            assert count[r] < maxd and room[r] >= size and room[r] == min(fitting), (size, room[r], fitting)
        room[r] -= size
        count[r] += 1


@settings(max_examples=300, deadline=None)
@given(windows(policies=("best-fit", "no-split")))
def test_best_fit_is_best_fit_decreasing(case):
    lengths, packing = case
    rows = pack_rows(lengths, packing)
    sizes = sizes_of(lengths, packing)
    replay_best_fit(rows, packing)
    seq = packing.seq_len
    for p, pieces in pieces_by_doc(rows).items():
        if sizes[p] <= seq:
            assert pieces == [(0, int(sizes[p]))]  # whole documents are never cut
        else:  # seq-token pieces and a tail
            assert [n for _, n in pieces] == [seq] * int(sizes[p] // seq) + (
                [int(sizes[p] % seq)] if sizes[p] % seq else []
            )
    assert rows.split_docs == (0 if packing.policy == "no-split" else int(np.count_nonzero(sizes > seq)))


def test_best_fit_small_example_and_tie_order():
    rows = pack_rows(np.array([3, 3, 3, 3, 5, 1]), Packing(6, "best-fit", max_docs_per_row=6))
    got = [sorted(rows.span_pos[a:b].tolist()) for a, b in zip(rows.row_offsets[:-1], rows.row_offsets[1:])]
    # 5 opens a row (room 1); the 3s fill two rows in window order; the 1 takes the least room.
    assert got == [[4, 5], [0, 1], [2, 3]]
    assert rows.fill_rate() == 1.0


def test_piece_bound_closes_rows():
    rows = pack_rows(np.ones(10, np.int64), Packing(8, "best-fit", max_docs_per_row=3))
    assert np.diff(rows.row_offsets).tolist() == [3, 3, 3, 1]
    rows = pack_rows(np.ones(10, np.int64), Packing(8, "concat", max_docs_per_row=3))
    assert np.diff(rows.row_offsets).tolist() == [3, 3, 3, 1]
    assert rows.row_tokens().tolist() == [3, 3, 3, 1]


def test_eos_adds_one_token_and_can_split():
    rows = pack_rows(np.array([4, 0]), Packing(4, "best-fit", eos_id=2))
    # 4 tokens + eos does not fit 4: a 4-token piece and a 1-token tail; the empty doc is its eos.
    assert sorted(zip(rows.span_pos.tolist(), rows.span_start.tolist(), rows.span_len.tolist())) == [
        (0, 0, 4),
        (0, 4, 1),
        (1, 0, 1),
    ]
    assert rows.split_docs == 1
    nosplit = pack_rows(np.array([4, 0]), Packing(4, "no-split", eos_id=2))
    assert nosplit.dropped.tolist() == [0] and nosplit.num_rows == 1
    empty = pack_rows(np.array([0, 0]), Packing(4, "best-fit"))
    assert empty.num_rows == 0 and empty.dropped.size == 0 and empty.fill_rate() == 1.0


def test_take_and_with_ids_select_batches():
    rows = pack_rows(np.array([5, 9, 2, 7, 3]), Packing(8, "concat"))
    ids = np.array([100, 101, 102, 103, 104])
    batch = rows.with_ids(ids).take(np.array([2, 0]))
    assert batch.num_rows == 2
    a, b = rows.row_offsets[2], rows.row_offsets[3]
    assert batch.span_pos[: b - a].tolist() == (ids[rows.span_pos[a:b]]).tolist()
    assert batch.span_len.tolist() == rows.span_len[a:b].tolist() + rows.span_len[: rows.row_offsets[1]].tolist()


def test_row_tokens_of_rows_without_spans():
    z = np.zeros(0, np.int64)
    rows = Rows(8, np.array([0, 0, 2, 2]), np.array([0, 1]), np.array([0, 0]), np.array([3, 4]), z, 0)
    assert rows.row_tokens().tolist() == [0, 7, 0]
    assert rows.take(np.array([1, 0])).row_tokens().tolist() == [7, 0]


def test_lognormal_window_fill_and_splits():
    lengths = lognormal_lengths(35_000, seed=3)
    best = pack_rows(lengths, Packing(8192, "best-fit", eos_id=0))
    concat = pack_rows(lengths, Packing(8192, "concat", eos_id=0))
    assert best.fill_rate() >= 0.995
    assert concat.split_docs >= 10 * max(best.split_docs, 1)
    est = rows_estimate(int(lengths.sum()), len(lengths), Packing(8192, "best-fit", eos_id=0))
    assert abs(est - best.num_rows) / best.num_rows < 0.01


def test_rows_estimate_for_no_split_subtracts_what_it_drops():
    lengths = lognormal_lengths(20_000, seed=4)
    packing = Packing(2048, "no-split", eos_id=0)
    rows = pack_rows(lengths, packing)
    long = lengths + 1 > 2048
    est = rows_estimate(int(lengths.sum()), len(lengths), packing, too_long=(int(long.sum()), int(lengths[long].sum())))
    assert abs(est - rows.num_rows) / rows.num_rows < 0.01
    assert rows_estimate(int(lengths.sum()), len(lengths), packing) > 1.05 * rows.num_rows  # without: counted as packed
    with pytest.raises(ValueError, match="exceeds the totals"):
        rows_estimate(10, 2, packing, too_long=(3, 5))


@pytest.mark.parametrize(
    "kwargs, msg",
    [
        ({"seq_len": 0}, "seq_len"),
        ({"seq_len": True}, "seq_len"),
        ({"seq_len": 8, "policy": "greedy"}, "policy"),
        ({"seq_len": 8, "eos_id": -1}, "eos_id"),
        ({"seq_len": 8, "max_docs_per_row": 0}, "max_docs_per_row"),
    ],
)
def test_bad_config_is_refused(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        Packing(**kwargs)


def test_bad_lengths_are_refused_with_the_position():
    with pytest.raises(ValueError, match="position 1 has length -3"):
        pack_rows(np.array([2, -3]), Packing(8))
    with pytest.raises(ValueError, match="1-D integer"):
        pack_rows(np.array([1.5]), Packing(8))


def test_default_piece_bound_and_fingerprint():
    assert default_max_docs(16) == 16 and default_max_docs(2048) == 64 and default_max_docs(8192) == 256
    assert Packing(np.int64(8)).max_docs_per_row == 8 and type(Packing(np.int64(8)).seq_len) is int
    assert Packing(8, "concat").fingerprint() != Packing(8, "best-fit").fingerprint()
    assert Packing(8).fingerprint() == Packing(8, max_docs_per_row=8).fingerprint()


def test_the_packing_stage_does_not_import_torch():
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = "import sys, shardtool.plan.packing, shardtool.plan.packing.bestfit; print('torch' in sys.modules)"
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": root},
        cwd=root,
    )
    assert res.returncode == 0 and res.stdout.strip() == "False", res.stdout + res.stderr


def test_a_slice_of_rows_is_the_same_as_taking_them():
    rows = pack_rows(np.array([5, 0, 17, 3, 40, 8, 1, 22], dtype=np.int64), Packing(16, "concat"))
    for a in range(rows.num_rows + 1):
        for z in range(a, rows.num_rows + 1):
            got, want = rows.slice(a, z), rows.take(np.arange(a, z))
            for field in ("row_offsets", "span_pos", "span_start", "span_len"):
                assert np.array_equal(getattr(got, field), getattr(want, field)), (a, z, field)
