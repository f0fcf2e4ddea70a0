"""Compressed shards read in place are decompressed once per rank into memory its workers share
(loader/inflate.py): batches equal the plain dataset's, a second pass decompresses nothing, and a
budget smaller than the share holds what fits and reads the rest record batch by record batch."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardtool
from helpers.data_gen import pack_compressed_pairs
from helpers.realtext import byte_ids, stdlib_files
from shardtool.loader import ShardedLoader
from shardtool.loader.inflate import Inflated, choose, inflate_budget

pytestmark = pytest.mark.timeout(240)


def _rows(n: int = 2500, seed: int = 11) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {"tokens": rng.integers(0, 500, int(rng.integers(1, 200))).astype(np.int32), "text": f"doc {i} " * (i % 5)}
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    return pack_compressed_pairs(_rows(), tmp_path_factory.mktemp("inflate"), (None, "zstd"), 120_000)


def _listed(batch) -> dict:
    return {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def _share_shards(ld) -> set[int]:
    shard, _ = ld.reader.locate(ld.plan.ids)
    return set(np.unique(shard).tolist())


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("ranks", [1, 3])
def test_each_shard_of_the_share_is_decompressed_once_per_run(packed, workers, ranks):
    kw = dict(max_tokens=1500, seed=5, rank=ranks - 1, world_size=ranks, ranks_per_node=1, num_workers=workers)
    ld = ShardedLoader(packed["zstd"], **kw)
    plain = ShardedLoader(packed[None], **kw)
    for epoch in range(2):
        ld.set_epoch(epoch)
        plain.set_epoch(epoch)
        assert [_listed(b) for b in ld] == [_listed(b) for b in plain]
        held = ld.reader.ctx.inflated
        # Only this rank's shards, every one of them, each decompressed once: the second pass none.
        assert set(held.copies) == _share_shards(ld)
        assert held.loaded == len(held.copies)
        # No reader, worker or trainer, saw a ready flag it could not believe.
        assert held.refused == 0, f"(shard, flag) {held.last_refused}"
    if ranks > 1:
        assert len(held.copies) < shardtool.open_dataset(packed["zstd"]).num_shards


def test_a_budget_smaller_than_the_share_holds_what_fits_and_reads_the_rest_by_record_batch(packed, monkeypatch):
    ds = shardtool.open_dataset(packed["zstd"])
    sizes = sorted(s.raw_bytes for s in ds.manifest.shards)
    monkeypatch.setenv("SHARDTOOL_DECOMPRESSED_SHARE", str(sizes[0] + sizes[1]))
    for workers in (0, 2):
        kw = dict(batch_size=7, seed=1, rank=0, world_size=1, num_workers=workers)
        ld = ShardedLoader(packed["zstd"], **kw)
        assert [_listed(b) for b in ld] == [_listed(b) for b in ShardedLoader(packed[None], **kw)]
        held = ld.reader.ctx.inflated
        assert 1 <= len(held.copies) <= 2 < ds.num_shards and held.nbytes <= sizes[0] + sizes[1]


def test_zero_turns_it_off_and_a_bad_size_is_named():
    assert inflate_budget({"SHARDTOOL_DECOMPRESSED_SHARE": "0"}) == 0
    assert inflate_budget({"SHARDTOOL_DECOMPRESSED_SHARE": "2GiB"}) == 2 << 30
    assert inflate_budget({"LOCAL_WORLD_SIZE": "8"}) * 8 <= inflate_budget({}) + 8
    with pytest.raises(ValueError, match="SHARDTOOL_DECOMPRESSED_SHARE"):
        inflate_budget({"SHARDTOOL_DECOMPRESSED_SHARE": "lots"})


@settings(max_examples=200, deadline=None)
@given(
    want=st.lists(st.integers(0, 30), unique=True, max_size=20),
    held=st.lists(st.integers(0, 30), unique=True, max_size=10),
    budget=st.integers(0, 4000),
    seed=st.integers(0, 2**16),
)
def test_choose_keeps_what_is_held_and_wanted_and_never_exceeds_the_budget(want, held, budget, seed):
    rng = np.random.default_rng(seed)
    sizes = {s: int(rng.integers(1, 600)) for s in range(31)}
    # What is held was chosen under the same budget before.
    held_sizes = {s: sizes[s] for s in choose(held, {}, sizes, budget)}
    out = choose(want, held_sizes, sizes, budget)
    assert out == [s for s in want if s in set(out)]  # the pass's order, nothing it does not read
    assert {s for s in want if s in held_sizes} <= set(out)  # a held shard still read stays
    assert sum(sizes[s] for s in out) <= budget
    # Greedy: a wanted shard left out did not fit beside those chosen.
    rest = budget - sum(sizes[s] for s in out)
    assert all(sizes[s] > rest for s in want if s not in set(out))


@pytest.mark.parametrize("seq_len", [256, 8192])
def test_real_text_in_place_packed_rows_equal_plain(tmp_path, seq_len):
    """Stdlib files as byte ids (long documents), packed rows at a short and a long seq_len."""
    rows = [{"tokens": byte_ids(p), "path": os.path.relpath(p)} for p in stdlib_files(300)]
    roots = {}
    for comp in (None, "zstd"):
        roots[comp] = str(tmp_path / (comp or "plain"))
        shardtool.pack(rows, roots[comp], format="arrow", length="tokens", shard_size=2_000_000, compression=comp)
    kw = dict(seq_len=seq_len, batch_size=4, packing="best-fit", eos_id=256, seed=2, world_size=2, rank=1)
    for workers in (0, 2):
        ld = ShardedLoader(roots["zstd"], num_workers=workers, **kw)
        got = [_listed(b) for b in ld]
        assert got and got == [_listed(b) for b in ShardedLoader(roots[None], num_workers=workers, **kw)]
        assert ld.reader.ctx.inflated.copies


def test_a_mixture_with_a_compressed_source_holds_it_decompressed_and_reads_it_like_plain(packed):
    from shardtool.loader import Mixture

    other = str(os.path.join(os.path.dirname(packed[None]), "other"))
    if not os.path.exists(other):
        shardtool.pack(_rows(600, seed=3), other, format="arrow", length="tokens", shard_size=60_000)
    kw = dict(steps=40, batch_size=6, seed=9, rank=0, world_size=1)
    for workers in (0, 2):
        ld = ShardedLoader(Mixture({"z": (packed["zstd"], 0.7), "o": (other, 0.3)}), num_workers=workers, **kw)
        want = ShardedLoader(Mixture({"z": (packed[None], 0.7), "o": (other, 0.3)}), num_workers=workers, **kw)
        got = [_listed(b) for b in ld]
        assert got == [_listed(b) for b in want] and len(got) == 40
        assert ld.readers["z"].ctx.inflated.copies and ld.readers["o"].ctx.inflated is None


def test_a_keep_compressed_cache_holds_what_is_cached_and_fetches_the_rest_on_a_miss(packed, tmp_path):
    from shardtool.cache import VersionDir, warm

    src, cdir = packed["zstd"], str(tmp_path / "cache")
    r = warm(src, cdir, all_shards=True, keep_compressed=True, progress=False)
    assert r.status == "ok" and not r.decompressed
    m = shardtool.open_dataset(src).manifest
    os.unlink(VersionDir(cdir, r.version).path(m.shards[1].path))  # not cached when the pass starts
    kw = dict(batch_size=9, seed=4, rank=0, world_size=1, num_workers=2)
    ld = ShardedLoader(src, cache_dir=cdir, **kw)
    plain = ShardedLoader(packed[None], **kw)
    assert [_listed(b) for b in ld] == [_listed(b) for b in plain]
    # Shard 1 was fetched on a miss during the pass, not decompressed whole before its first batch.
    assert set(ld.reader.ctx.inflated.copies) == set(range(len(m.shards))) - {1}
    ld.set_epoch(1)
    plain.set_epoch(1)
    assert [_listed(b) for b in ld] == [_listed(b) for b in plain]
    assert set(ld.reader.ctx.inflated.copies) == set(range(len(m.shards)))  # cached now: held from epoch 1


def test_closing_the_loader_frees_what_it_held_and_a_later_pass_decompresses_again(packed):
    ld = ShardedLoader(packed["zstd"], batch_size=11, seed=0, rank=0, world_size=1, num_workers=0)
    first = [_listed(b) for b in ld]
    held = ld.reader.ctx.inflated
    maps = list(held.copies.values())
    assert maps and held.loaded == len(maps)
    ld.close()
    assert not held.copies and all(m.closed for m in maps)
    ld.set_epoch(0)
    assert [_listed(b) for b in ld] == first  # the same epoch again, read after closing: decompressed anew
    assert held.loaded == 2 * len(maps)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    world=st.sampled_from([1, 2, 3]),
    workers=st.sampled_from([0, 0, 2]),
    at=st.floats(0.0, 1.0, exclude_max=True),  # 1.0: a state at the end of an epoch is the next one's start
    seed=st.integers(0, 2**16),
)
def test_a_resumed_pass_in_place_equals_the_plain_datasets_on_any_layout(packed, world, workers, at, seed):
    """Exact resume holds where shards are held decompressed: a state saved part-way through an
    epoch of the compressed dataset continues with the batches the plain dataset has there."""
    kw = dict(max_tokens=1200, seed=seed, rank=world - 1, world_size=world, ranks_per_node=1)
    want = [_listed(b) for b in ShardedLoader(packed[None], num_workers=0, **kw)]
    ld = ShardedLoader(packed["zstd"], num_workers=workers, **kw)
    k = int(at * len(ld))
    it = iter(ld)
    for _ in range(k):
        next(it)
    state = ld.state_dict()
    ld.close()
    again = ShardedLoader(packed["zstd"], num_workers=workers, **kw)
    again.load_state_dict(state)
    assert [_listed(b) for b in again] == want[k:]


def test_a_shard_larger_than_its_recorded_plain_size_is_decompressed_whole(packed):
    """An older manifest's size, a wrong one or none: the same plain file, written again growing."""
    import mmap

    import pyarrow as pa

    from shardtool.loader.inflate import decompress

    ds = shardtool.open_dataset(packed["zstd"])
    info = ds.manifest.shards[0]
    with open(ds.shard_path(0), "rb") as f:
        data = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    outs = [decompress(data, info.path, size) for size in (info.raw_bytes, 1000, 0)]
    assert outs[0][:] == outs[1][:] == outs[2][:]
    plain = pa.ipc.open_file(pa.py_buffer(outs[0]))
    stored = pa.ipc.open_file(pa.py_buffer(data))
    assert plain.num_record_batches == stored.num_record_batches
    assert plain.read_all().equals(stored.read_all())


def _in_order(workers: int) -> dict:
    return dict(batch_size=7, shuffle=False, rank=0, world_size=1, num_workers=workers)


def _held_back(ld, free_shards: int):
    """``ld``'s fill lets ``free_shards`` shards through, then waits until the event returned is set
    (or the loader stops it): the pass's progress against the fill observed, not timed."""
    import threading

    go = threading.Event()
    held = ld.reader.ctx.inflated = Inflated(inflate_budget(os.environ))

    def pace(k, stop):
        while k >= free_shards and not (go.is_set() or stop.is_set()):
            go.wait(0.01)

    held.pace = pace
    return held, go


@pytest.mark.parametrize("workers", [0, 2])
def test_the_first_batch_arrives_before_the_share_is_decompressed(packed, workers):
    kw = _in_order(workers)
    ld = ShardedLoader(packed["zstd"], **kw)
    held, go = _held_back(ld, 1)
    it = iter(ld)
    first = _listed(next(it))
    # Shard 0 only: the fill waits before the next one, and the batch did not wait for it.
    assert held.loaded == 1 and held.filling and set(held.copies) == {0}
    go.set()
    got = [first] + [_listed(b) for b in it]
    assert got == [_listed(b) for b in ShardedLoader(packed[None], **kw)]
    assert not held.filling and held.loaded == len(held.copies) == shardtool.open_dataset(packed["zstd"]).num_shards


def test_a_ready_flag_that_is_not_a_file_is_counted_and_the_shard_read_the_ordinary_way(packed):
    # A worker once read a 1-byte copy of a shard off the board (cause not yet found): such a flag
    # must cost a slower read of that shard, not the pass, and be counted where the rank sees it.
    kw = _in_order(2)
    ld = ShardedLoader(packed["zstd"], **kw)
    held = ld.reader.ctx.inflated = Inflated(inflate_budget(os.environ))

    def pace(k, stop):  # the fill writes nothing; every flag reads as a 1-byte file
        for s in held._arena.slot:
            held._arena.set(s, 1)
        stop.wait()

    held.pace = pace
    got = [_listed(b) for b in ld]
    assert held.refused >= 1 and not held.copies and held.last_refused[1] == 1
    ld.close()  # the fill, held back, stops
    assert got == [_listed(b) for b in ShardedLoader(packed[None], **kw)]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_block_shuffle_has_its_first_batch_from_the_first_shards_the_fill_writes(packed, workers):
    # Issue 32 item 10: a shuffled pass draws its first batch from the whole share, so it waits for
    # the share's decompression; a block-wise shuffle of about a shard's samples reads a shard or
    # two at a time, and its first batch needs only what the fill writes first.
    m = shardtool.open_dataset(packed["zstd"]).manifest
    per_shard = m.num_samples // len(m.shards)
    assert len(m.shards) >= 4
    kw = dict(batch_size=7, seed=2, rank=0, world_size=1, num_workers=workers, shuffle_block=per_shard)
    ld = ShardedLoader(packed["zstd"], **kw)
    held, go = _held_back(ld, 2)
    it = iter(ld)
    first = _listed(next(it))
    assert held.filling and held.loaded <= 2  # the fill is held after two shards: it did not wait for more
    go.set()
    got = [first] + [_listed(b) for b in it]
    assert got == [_listed(b) for b in ShardedLoader(packed[None], **kw)]
    assert held.refused == 0 and held.loaded == len(m.shards)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_shard_failing_verification_mid_fill_is_named_and_the_batches_before_it_arrive(packed, tmp_path, workers):
    import shutil

    root = str(tmp_path / "z")
    shutil.copytree(packed["zstd"], root)
    ds = shardtool.open_dataset(root)
    bad = ds.manifest.shards[2].path
    with open(ds.shard_path(2), "r+b") as f:  # one byte of its middle flipped: same size, other hash
        f.seek(ds.manifest.shards[2].bytes // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    kw = _in_order(workers)
    want = [_listed(b) for b in ShardedLoader(packed[None], **kw)]
    ld = ShardedLoader(root, **kw)
    got = []
    with pytest.raises(shardtool.FormatError, match=bad):
        for b in ld:
            got.append(_listed(b))
    shard, _ = ld.reader.locate(ld.plan.ids)
    before = int(np.flatnonzero(shard == 2)[0])  # samples before shard 2's first, in dataset order
    assert got and sum(len(b["__key__"]) for b in got) <= before and got == want[: len(got)]
    held = ld.reader.ctx.inflated
    assert 2 not in held.copies and {0, 1} <= set(held.copies)
    ld.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_closing_mid_fill_stops_it_and_frees_its_memory(packed, workers):
    import threading

    kw = _in_order(workers)
    ld = ShardedLoader(packed["zstd"], **kw)
    held, _ = _held_back(ld, 1)
    it = iter(ld)
    next(it)
    assert held.filling
    maps = list(held.copies.values())
    arena = held._arena
    ld.close()
    assert not held.filling and not any(t.name == "shardtool-inflate" for t in threading.enumerate())
    assert held.loaded == 1 and not held.copies and all(m.closed for m in maps)
    assert held._arena is None and arena._fd is None  # the memory file closed: its pages go with it


def test_a_shard_written_into_shared_memory_is_the_plain_file_the_cache_writes(packed):
    import mmap

    import pyarrow as pa

    from shardtool.format.decompress import Decompressor
    from shardtool.loader.batchcache import decompress_pool
    from shardtool.loader.inflatefill import Arena, write_shared

    ds = shardtool.open_dataset(packed["zstd"])
    with open(ds.shard_path(0), "rb") as f:
        data = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    want = pa.BufferOutputStream()
    Decompressor(data, "s0").write_plain(want)
    want = want.getvalue().to_pybytes()
    arena = Arena({0: len(want) + 100, 1: 10})
    for pool in (None, decompress_pool()):
        region = arena.region(0)
        n = write_shared(region, data, "s0", pool)
        assert n == len(want) and arena.view(0, n)[:] == want
        region.close()
        assert write_shared(arena.region(1), data, "s0", pool) is None  # does not fit: None, not an error
    arena.close()
