"""Packed rows on real text (the stdlib's files as byte ids): drop_last=False serves every token
once an epoch, drop_last=True reports exactly the tokens it leaves out (in tokens and pieces), a
split document's pieces come head first, and the plan's split count counts documents."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.realdata import icon_text_lengths
from helpers.realtext import issue32_lengths, stdlib_lengths, stdlib_line_lengths
from helpers.strategies import LAYOUTS
from shardtool.plan import ArraySource, Batching, DataLayout, Layout, Planner
from shardtool.plan.packing import Packing
from shardtool.plan.simulate import simulate_epoch

DATASET = "manifest-sha-packed"


# Read once: hypothesis draws a corpus per example.
_issue = functools.lru_cache(maxsize=1)(issue32_lengths)
_stdlib = functools.lru_cache(maxsize=1)(stdlib_lengths)
_lines = functools.lru_cache(maxsize=1)(lambda: stdlib_line_lengths(6000))


def _shards(size: int, per: int) -> np.ndarray:
    counts = np.full(size // per, per, np.int64)
    return np.append(counts, size - counts.sum()) if size % per else counts


@st.composite
def corpora(draw) -> np.ndarray:
    kind = draw(st.sampled_from(["issue", "stdlib", "lines"]))
    if kind == "issue":
        return _issue()
    pool = _stdlib() if kind == "stdlib" else _lines()
    size = draw(st.integers(20, 1200 if kind == "stdlib" else 6000))
    first = draw(st.integers(0, pool.size - size))
    return pool[first : first + size]


def _spans(plans) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every served span (document, start, length) and its serving key (step, DP rank, row)."""
    pos, start, size, key = [], [], [], []
    for p in plans:
        rows = p.rows
        batch = np.repeat(np.arange(p.batches_per_rank), np.diff(p.row_offsets))
        row = np.arange(rows.num_rows) - p.row_offsets[batch]
        per_row = np.diff(rows.row_offsets)
        k = (batch * 64 + p.dp_rank) * 4096 + row  # step, then DP rank (< 64), then row (< 4096)
        pos.append(rows.span_pos)
        start.append(rows.span_start)
        size.append(rows.span_len)
        key.append(np.repeat(k, per_row))
    return tuple(np.concatenate(a) for a in (pos, start, size, key))  # type: ignore[return-value]


def _plans(source, batching: Batching, dl: DataLayout, epoch: int) -> tuple[Planner, list]:
    """Every DP rank's plan of ``epoch`` (equal batch counts checked), or none where the dataset
    is too small for the layout (the plan says so)."""
    planner = Planner(source, batching)
    try:
        state = planner.start(epoch, DATASET, dl)
    except ValueError as e:
        assert "too small" in str(e)
        return planner, []
    plans = [planner.rank_plan(state, d) for d in range(dl.dp_size)]
    assert len({p.batches_per_rank for p in plans}) == 1, "equal batch counts"
    return planner, plans


def _assert_covers(pos, start, size, full: np.ndarray) -> None:
    """The spans tile every document [0, full) exactly once: no token twice, none missing."""
    order = np.lexsort((start, pos))
    pos, start, size = pos[order], start[order], size[order]
    new = np.ones(pos.size, bool)
    new[1:] = pos[1:] != pos[:-1]
    assert (start[new] == 0).all(), "every document from its first token"
    assert (start[~new] == (start + size)[np.flatnonzero(~new) - 1]).all(), "no gap, no overlap"
    assert np.array_equal(np.bincount(pos, weights=size, minlength=full.size).astype(np.int64), full)


def _assert_head_first(pos, start, key) -> None:
    """Served in (step, DP rank, row) order, a document's pieces come in the order of its tokens."""
    order = np.lexsort((key, pos))
    pos, start = pos[order], start[order]
    same = pos[1:] == pos[:-1]
    assert (start[1:][same] > start[:-1][same]).all(), "a later piece of a document was served first"


@settings(max_examples=60, deadline=None)
@given(
    corpora(),
    st.sampled_from(LAYOUTS),
    st.integers(256, 8192),
    st.integers(1, 8),
    st.sampled_from(["best-fit", "concat", "stream"]),
    st.sampled_from([None, 0]),
    st.integers(0, 5),
    st.sampled_from([7, 100, 333]),
)
def test_drop_last_false_serves_every_token_once_and_true_reports_what_it_leaves(
    lengths, layout, seq, per_batch, policy, eos, epoch, shard
):
    source = ArraySource(lengths, _shards(lengths.size, shard))
    packing = Packing(seq, policy, eos_id=eos)
    full = lengths + packing.extra_tokens
    dl = DataLayout.pure_dp(layout)
    for drop_last in (False, True):
        planner, plans = _plans(
            source, Batching(batch_size=per_batch, packing=packing, seed=epoch, drop_last=drop_last), dl, epoch
        )
        if not plans:
            return
        assert all(int(np.diff(p.row_offsets).max()) <= per_batch for p in plans)
        pos, start, size, key = _spans(plans)
        _assert_head_first(pos, start, key)
        firsts = [dl.first_dp_rank(g) for g in range(dl.num_groups)]  # one rank per group reports it
        reported = sum(plans[d].remainder_tokens for d in firsts)
        if not drop_last:
            _assert_covers(pos, start, size, full)
            assert reported == 0 and all(p.remainder_pieces == 0 and p.remainder.size == 0 for p in plans)
            continue
        assert reported == int(full.sum() - size.sum()), "the remainder is exactly the tokens not served"
        left = [planner.group(dl, g, epoch).left_out for g in range(dl.num_groups)]
        assert sum(plans[d].remainder_pieces for d in firsts) == sum(len(x.span_pos) for x in left)
        every = [np.concatenate([a, *(getattr(x, f) for x in left)]) for a, f in zip((pos, start, size), FIELDS)]
        _assert_covers(*every, full)


FIELDS = ("span_pos", "span_start", "span_len")


def test_the_issue_corpus_on_one_rank_serves_every_token():
    """1,003 documents at seq_len 1,024 on one rank: 3,072 tokens went unserved, remainder []."""
    lengths = _issue()
    source = ArraySource(lengths, _shards(lengths.size, 100))
    dl = DataLayout.pure_dp(Layout(1, 1))
    for per_batch in (1, 4, 8):
        planner = Planner(source, Batching(batch_size=per_batch, packing=Packing(1024), drop_last=False))
        plan = planner.rank_plan(planner.start(0, DATASET, dl), 0)
        pos, start, size, key = _spans([plan])
        _assert_covers(pos, start, size, lengths)
        _assert_head_first(pos, start, key)
        assert plan.remainder_tokens == 0


def test_split_count_is_documents_in_more_than_one_piece():
    lengths = _issue()
    source = ArraySource(lengths, _shards(lengths.size, 100))
    for layout, drop_last in ((Layout(1, 1), False), (Layout(2, 3), True)):
        dl = DataLayout.pure_dp(layout)
        batching = Batching(batch_size=4, packing=Packing(1024), drop_last=drop_last)
        sim = simulate_epoch(source, dl, batching)
        planner = Planner(source, batching)
        groups = [planner.group(dl, g, 0) for g in range(dl.num_groups)]
        pos = np.concatenate([x for g in groups for x in (g.rows.span_pos, g.left_out.span_pos)])
        direct = int(np.count_nonzero(np.bincount(pos) > 1))
        assert sim.split_docs == direct
        # best-fit cuts only the documents longer than a row (and, rarely, one the fit-up merges)
        assert int((lengths > 1024).sum()) <= sim.split_docs <= int((lengths > 1024).sum()) + 4


@settings(max_examples=40, deadline=None)
@given(
    corpora(),
    st.sampled_from(LAYOUTS),
    st.integers(256, 8192),
    st.integers(1, 8),
    st.sampled_from([None, 0]),
    st.integers(0, 5),
    st.booleans(),
)
def test_no_split_never_cuts_a_document(lengths, layout, seq, per_batch, eos, epoch, drop_last):
    """Not when rows are merged to serve every token, nor when rows are cut to give a deficit group
    its batches: an image's placeholders are never cut across rows. Each document that fits a row
    is served whole, at most once; without drop_last, exactly once unless the plan reports it."""
    source = ArraySource(lengths, _shards(lengths.size, 100))
    packing = Packing(seq, "no-split", eos_id=eos)
    full = lengths + packing.extra_tokens
    dl = DataLayout.pure_dp(layout)
    _, plans = _plans(
        source, Batching(batch_size=per_batch, packing=packing, seed=epoch, drop_last=drop_last), dl, epoch
    )
    if not plans:
        return
    pos, start, size, _ = _spans(plans)
    assert (start == 0).all() and np.array_equal(size, full[pos]), "a document was cut"
    assert np.unique(pos).size == pos.size, "a document served twice"
    firsts = [dl.first_dp_rank(g) for g in range(dl.num_groups)]
    reported = sum(plans[d].remainder_tokens for d in firsts)
    fits = int(full[full <= seq].sum())
    assert reported == fits - int(size.sum()), "what is not served is what is reported"
    if not drop_last:
        assert reported == 0, "drop_last=False serves every document that fits a row"


@pytest.mark.parametrize("sides", [(512, 256), (512, 256, 96, 64)])
@pytest.mark.parametrize("seq", [1024, 2048])
def test_no_split_serves_image_text_documents_that_cannot_share_rows(sides, seq):
    """Real icons' image-text documents (576 placeholders and a caption: just over half a row of
    1,024, a third of 2,048) take a row each, or three to a row: counted from their tokens, one
    rank got rows for 44 of 74 and left the rest out unreported. Serving every document, each
    layout serves them all; dropping for equal counts (several ranks), at most 1% of tokens."""
    lengths = icon_text_lengths(sides)
    source = ArraySource(lengths, _shards(lengths.size, 25))
    packing = Packing(seq, "no-split", eos_id=0)
    full = lengths + packing.extra_tokens
    for layout in (Layout(1, 1), Layout(1, 3), Layout(2, 2), Layout(4, 2)):
        dl = DataLayout.pure_dp(layout)
        for drop_last in (None, False):
            batching = Batching(batch_size=4, packing=packing, drop_last=drop_last)
            _, plans = _plans(source, batching, dl, 0)
            pos, _, size, _ = _spans(plans)
            assert np.unique(pos).size == pos.size
            if not batching.drops(dl.dp_size):
                assert np.array_equal(np.sort(pos), np.arange(lengths.size)), (layout, drop_last)
            else:
                assert full.sum() - size.sum() <= 0.01 * full.sum(), (layout, drop_last)


def test_no_split_counts_each_dropped_document_once_and_not_as_a_remainder():
    """The issue corpus at rows of 1,024: 617 documents are longer than a row. The plan counted
    1,234 dropped (2,468 with drop_last=False: every copy of the rows carried them), and its
    remainder named them as "documents wholly: empty ones"."""
    lengths = _issue()
    source = ArraySource(lengths, _shards(lengths.size, 100))
    for layout, drop_last in ((Layout(1, 1), False), (Layout(1, 2), None), (Layout(2, 3), True)):
        dl = DataLayout.pure_dp(layout)
        batching = Batching(batch_size=4, packing=Packing(1024, "no-split"), drop_last=drop_last)
        assert simulate_epoch(source, dl, batching).dropped_docs == int((lengths > 1024).sum())
        planner = Planner(source, batching)
        remainder = np.concatenate([planner.group(dl, g, 0).remainder for g in range(dl.num_groups)])
        assert not (lengths[remainder] > 1024).any(), "a document too long for a row is dropped, not a remainder"


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 70_000), min_size=1, max_size=300),
)
def test_no_split_s_correction_prices_its_sample_as_the_plan_prices_a_group(lengths):
    # fragmentation divides by the estimate the plan makes of a group from its summaries: the
    # sample's histogram must be the one a shard's summaries hold of the same lengths.
    from shardtool.format.summaries import ShardSummaries
    from shardtool.plan.binrows import histogram_of

    arr = np.asarray(lengths, dtype=np.int64)
    summaries = ShardSummaries.from_lengths(arr, np.array([arr.size]))
    count, tokens = histogram_of(arr)
    assert np.array_equal(count, summaries.hist_count[0]) and np.array_equal(tokens, summaries.hist_tokens[0])
