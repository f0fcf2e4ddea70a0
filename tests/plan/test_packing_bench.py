"""The reference packers of benchmarks/packing.py count what they claim (the comparison is only as
honest as they are)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.packing import FirstFitBuffer, first_fit_run, greedy_concat_split, ours


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=2500), st.integers(2, 64))
def test_greedy_concat_split_counts_cut_documents(sizes, seq):
    sizes = np.asarray(sizes, dtype=np.int64)
    got = greedy_concat_split(sizes, seq)
    rows = kept = cut = 0
    for a in range(0, len(sizes), 1000):  # token by token: which documents' tokens land in 2+ places
        part = sizes[a : a + 1000]
        owner = np.repeat(np.arange(len(part)), part)
        blocks = len(owner) // seq
        place = np.minimum(np.arange(len(owner)) // seq, blocks)  # block, or `blocks` for the dropped rest
        cut += sum(len(set(place[owner == d].tolist())) > 1 for d in range(len(part)))
        rows += blocks
        kept += blocks * seq
    assert got["rows"] == rows and got["docs_split"] == cut
    assert np.isclose(got["tokens_dropped"], 1 - kept / sizes.sum())


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(1, 100), min_size=1, max_size=400), st.integers(8, 80), st.integers(1, 4), st.integers(1, 30)
)
def test_first_fit_buffer_conserves_tokens(sizes, seq, rows, raw):
    sizes = np.asarray(sizes, dtype=np.int64)
    raw = max(raw, rows)
    buf = first_fit_run(sizes, seq, rows, raw)
    clipped = np.minimum(sizes, seq)
    fed = sum(int(clipped[a : a + raw].sum()) for a in range(0, len(sizes), raw) if len(clipped[a : a + raw]) >= rows)
    assert buf.total == fed
    assert buf.packed + sum(buf.bins) == fed
    assert all(b <= seq for b in buf.bins) and buf.packed <= buf.rows * seq


def test_first_fit_takes_the_first_bin_that_fits():
    buf = FirstFitBuffer(1, 10)
    buf.add([6, 5, 4, 3])
    # 6 -> [6]; 5 -> new [6, 5]; 4 -> first fit is 6 (10); 3 -> 5 (8): fullest bin emitted.
    assert buf.packed == 10 and buf.bins == [8]


def test_ours_reports_every_token():
    sizes = np.random.default_rng(0).integers(1, 3000, 5000) + 1
    for policy in ("concat", "best-fit"):
        r = ours(sizes, 2048, policy, 4)
        assert r["tokens_dropped"] == 0 and abs(r["estimate_error"]) < 0.01
