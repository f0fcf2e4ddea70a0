"""``trace`` (issue 35 item 1): what a rank's batch at a step holds, from the plan alone, equals
what the loader delivered there. Real data: stdlib files and /usr/share/doc text as byte ids
(long documents, split across rows at small seq_len), bucketed by a token budget or packed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shardtool
from helpers.realtext import byte_ids, doc_files, stdlib_files
from helpers.skips import require
from shardtool.loader import ShardedLoader
from shardtool.loader.trace import trace
from shardtool.plan.mixture import Mixture

pytestmark = pytest.mark.timeout(300)

EOS = 256  # byte ids are 0..255
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def real_ds(tmp_path_factory):
    """200 stdlib files under 60 KB (documents of up to 60k tokens, split across rows) and 400
    small /usr/share/doc files as byte ids + eos, in a fixed mixed order, Arrow shards of ~1 MB."""
    small = [p for p in doc_files() if 0 < os.path.getsize(p) < 4096][:400]
    require(len(small) >= 200, "too few small files under /usr/share/doc")
    paths = [p for p in stdlib_files(400) if os.path.getsize(p) < 60_000][:200] + small
    order = np.random.default_rng(1).permutation(len(paths))
    docs = [np.append(byte_ids(paths[i]), EOS).astype(np.int32) for i in order]
    root = str(tmp_path_factory.mktemp("trace") / "ds")
    shardtool.pack([{"tokens": d} for d in docs], root, format="arrow", length="tokens", shard_size=1_000_000)
    return root


def _delivered(batch: dict, packed: bool) -> list[tuple]:
    """What the batch itself says it holds: keys in order; packed, per piece (row, key, offset in
    its document, tokens), from ``__key__``, ``doc_offsets`` and ``cu_seqlens``."""
    if not packed:
        return [(str(k),) for k in batch["__key__"]]
    b, seq = batch["input_ids"].shape
    cu, offs, real = batch["cu_seqlens"].tolist(), batch["doc_offsets"].tolist(), batch["lengths"].tolist()
    out, k = [], 0
    for r in range(b):
        for key in batch["__key__"][r]:
            start, end = cu[k] - r * seq, min(cu[k + 1] - r * seq, real[r])  # padding: the last piece's tail
            out.append((r, str(key), offs[k], end - start))
            k += 1
    return out


def _traced(t: dict, packed: bool) -> list[tuple]:
    if not packed:
        return [(s["key"],) for s in t["samples"]]
    return [(s["row"], s["key"], s["offset"], s["length"]) for s in t["samples"]]


KINDS = {
    "bucketed": dict(max_tokens=65536),
    "packed-256": dict(seq_len=256, batch_size=4),
    "packed-2048": dict(seq_len=2048, batch_size=2, packing="best-fit"),
}


@pytest.mark.parametrize("kind", ["bucketed", "packed-256"])
def test_the_batch_in_hand_is_traced_in_its_epoch_also_the_last_one(real_ds, kind):
    """In the training loop, `trace(loader, step)` names the batch just delivered. During an
    epoch's last batch the loader's `epoch` (and a state saved then) is already the next one, and
    the trace answered for that epoch's step: every rank's last step mismatched."""
    packed = "seq_len" in KINDS[kind]
    ld = ShardedLoader(real_ds, num_workers=0, seed=4, metrics=False, **KINDS[kind])
    for epoch in (0, 1):
        for step, batch in enumerate(ld):
            assert _traced(trace(ld, step), packed) == _delivered(batch, packed), (epoch, step)
        assert ld.epoch == epoch + 1 and ld.handed_epoch == epoch  # between epochs: the one just served
    ld.close()


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("ranks, workers", [(1, 0), (3, 2)])
def test_every_step_traced_equals_the_batch_delivered(real_ds, kind, ranks, workers):
    packed = "seq_len" in KINDS[kind]
    for rank in range(ranks):
        kw = dict(KINDS[kind], seed=4, rank=rank, world_size=ranks, ranks_per_node=ranks, metrics=False)
        ld = ShardedLoader(real_ds, num_workers=workers, **kw)
        ld.set_epoch(1)
        got = [_delivered(b, packed) for b in ld]
        ld.close()
        fresh = ShardedLoader(real_ds, num_workers=0, **kw)  # another process's view: nothing iterated
        for step, want in enumerate(got):
            t = trace(fresh, step, epoch=1)
            assert _traced(t, packed) == want, (kind, rank, step)
            assert t["epoch"] == 1 and t["step"] == step and t["rank"] == rank
        with pytest.raises(ValueError, match="past epoch 1's end"):
            trace(fresh, len(got), epoch=1)
        fresh.close()


def test_a_sample_is_named_by_key_shard_and_place(real_ds):
    ld = ShardedLoader(real_ds, max_tokens=65536, seed=0, rank=0, world_size=1, num_workers=0, metrics=False)
    ds = shardtool.open_dataset(real_ds)
    for s in trace(ld, 3)["samples"]:
        shard = [m.path for m in ds.manifest.shards].index(s["shard"])
        assert ds.read(shard, s["index"])["__key__"] == s["key"]
        assert int(np.sum(ds.shard_counts[:shard])) + s["index"] == s["sample"]
        assert len(ds.read(shard, s["index"])["tokens"]) == s["length"]


@settings(max_examples=8, deadline=None)
@given(
    before=st.sampled_from([(2, 1), (3, 1), (1, 2)]),  # (ranks per node, nodes) saved on
    after=st.sampled_from([(2, 1), (1, 1), (4, 1)]),
    fraction=st.floats(0.1, 0.9),
    seed=st.integers(0, 100),
)
def test_after_an_elastic_resume_the_trace_is_what_the_resumed_loader_serves(real_ds, before, after, fraction, seed):
    kw = dict(seq_len=512, batch_size=2, seed=seed, num_workers=0, metrics=False)
    (per0, nodes0), (per1, nodes1) = before, after
    first = ShardedLoader(real_ds, rank=0, world_size=per0 * nodes0, ranks_per_node=per0, **kw)
    served = max(1, int(len(first) * fraction))
    it = iter(first)
    for _ in range(served):
        next(it)
    state = first.state_dict()
    first.close()
    for rank in range(per1 * nodes1):
        ld = ShardedLoader(real_ds, rank=rank, world_size=per1 * nodes1, ranks_per_node=per1, **kw)
        ld.load_state_dict(json.loads(json.dumps(state)))
        steps = list(range(len(ld) - ld.batches_left, len(ld)))
        traced = [_traced(trace(ld, s), True) for s in steps]
        if steps and steps[0] > 0 and (per1, nodes1) != (per0, nodes0):
            with pytest.raises(ValueError, match="earlier layout"):
                trace(ld, steps[0] - 1)
        assert [_delivered(b, True) for b in ld] == traced
        ld.close()


@pytest.fixture(scope="module")
def second_ds(tmp_path_factory):
    """A second source: 300 other /usr/share/doc files (under 8 KB) as byte ids + eos."""
    files = [p for p in doc_files() if 4096 <= os.path.getsize(p) < 8192][:300]
    require(len(files) >= 100, "too few /usr/share/doc files of 4-8 KB")
    root = str(tmp_path_factory.mktemp("trace2") / "ds")
    docs = [np.append(byte_ids(p), EOS).astype(np.int32) for p in files]
    shardtool.pack([{"tokens": d} for d in docs], root, format="arrow", length="tokens", shard_size=1_000_000)
    return root


def _state_after(loader, steps: int) -> dict:
    """``loader``'s state after it served ``steps`` batches (the loader closed)."""
    it = iter(loader)
    for _ in range(steps):
        next(it)
    state = loader.state_dict()
    loader.close()
    return state


def _mixed(batch: dict, packed: bool) -> list[tuple]:
    """A mixture's batch as `_delivered`, each entry with its source in front."""
    got = _delivered(batch, packed)
    if not packed:
        return [(batch["__source__"], *g) for g in got]
    return [(batch["__source__"][g[0]], *g) for g in got]


@pytest.mark.parametrize("packed", [False, True])
def test_a_mixtures_steps_traced_equal_its_batches_also_after_new_weights(real_ds, second_ds, packed):
    from shardtool.plan.mixture import Mixture

    size = dict(seq_len=512, batch_size=4) if packed else dict(max_tokens=65536)
    kw = dict(size, seed=1, steps=40, rank=1, world_size=2, ranks_per_node=2, metrics=False, num_workers=0)
    sources = {"lib": (real_ds, 0.6), "doc": (second_ds, 0.4)}
    ld = ShardedLoader(Mixture(sources, schedule=[(20, {"lib": 0.2, "doc": 0.8})], max_repeat=20), **kw)
    it = iter(ld)
    first = [_mixed(next(it), packed) for _ in range(15)]
    state = ld.state_dict()
    ld.close()
    again = ShardedLoader(Mixture(sources, schedule=[(20, {"lib": 0.2, "doc": 0.8})], max_repeat=20), **kw)
    for step, want in enumerate(first):  # a fresh loader of the same run: nothing iterated
        t = trace(again, step)
        assert [(x["source"], *_traced({"samples": [x]}, packed)[0]) for x in t["samples"]] == want, step
    again.close()
    # Resumed at step 15 under other weights: a new phase; its steps are traced, the earlier refused.
    changed = Mixture({"lib": (real_ds, 0.9), "doc": (second_ds, 0.1)}, max_repeat=20)
    resumed = ShardedLoader(changed, **kw)
    resumed.load_state_dict(state)
    traced = [
        [(x["source"], *_traced({"samples": [x]}, packed)[0]) for x in trace(resumed, s)["samples"]]
        for s in range(15, 40)
    ]
    with pytest.raises(ValueError, match="earlier phase"):
        trace(resumed, 14)
    with pytest.raises(ValueError, match="past the mixture's end"):
        trace(resumed, 40)
    assert [_mixed(b, packed) for b in resumed] == traced
    resumed.close()


def test_the_cli_prints_a_ranks_step_as_the_loader_traces_it(real_ds):
    ld = ShardedLoader(
        real_ds, seq_len=256, batch_size=4, seed=2, rank=1, world_size=3, ranks_per_node=3, metrics=False
    )
    want = trace(ld, 5)
    ld.close()
    args = ["trace", real_ds, "--step", "5", "--rank", "1", "--ranks-per-node", "3", "--seq-len", "256"]
    args += ["--batch-size", "4", "--seed", "2"]
    out = subprocess.run(
        [sys.executable, "-m", "shardtool", *args, "--json"], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == want
    text = subprocess.run([sys.executable, "-m", "shardtool", *args], capture_output=True, text=True, timeout=120)
    assert text.returncode == 0, text.stderr
    first = want["samples"][0]
    assert f"{first['key']}" in text.stdout and first["shard"] in text.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "shardtool", *args[:3], "99999", *args[4:]], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode != 0 and "past epoch 0's end" in bad.stderr


def test_the_cli_traces_a_mixture_files_step(real_ds, second_ds, tmp_path):
    from shardtool.plan.mixture import Mixture

    path = tmp_path / "mix.json"
    path.write_text(
        json.dumps(
            {
                "sources": {"lib": {"url": real_ds, "weight": 0.7}, "doc": {"url": second_ds, "weight": 0.3}},
                "max_repeat": 20,
            }
        )
    )
    kw = dict(seq_len=512, batch_size=4, seed=3, rank=1, world_size=2, ranks_per_node=2, metrics=False)
    ld = ShardedLoader(Mixture.from_file(str(path)), steps=30, **kw)
    want = trace(ld, 7)
    ld.close()
    args = ["trace", str(path), "--steps", "30", "--step", "7", "--rank", "1", "--ranks-per-node", "2"]
    args += ["--seq-len", "512", "--batch-size", "4", "--seed", "3"]
    out = subprocess.run(
        [sys.executable, "-m", "shardtool", *args, "--json"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == want and {s["source"] for s in want["samples"]} <= {"lib", "doc"}
    text = subprocess.run([sys.executable, "-m", "shardtool", *args], capture_output=True, text=True, timeout=120)
    assert text.returncode == 0 and "source" in text.stdout.splitlines()[1], text.stdout + text.stderr
    alone = subprocess.run(
        [sys.executable, "-m", "shardtool", "trace", real_ds, "--steps", "3", "--step", "0", "--max-tokens", "65536"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert alone.returncode == 1 and "a dataset has epochs" in alone.stderr


@pytest.mark.parametrize("kind", ["bucketed", "packed-256"])
def test_find_names_every_step_and_rank_that_serves_a_sample(real_ds, kind):
    """The other way round: each sample's steps, DP ranks (and pieces) equal what the traces of
    every step of every rank hold; a sample left out of the epoch is served nowhere."""
    from shardtool.loader.trace import find, sample_of

    packed = "seq_len" in KINDS[kind]
    ranks = 3
    seen: dict[int, list[tuple]] = {}
    loaders = [
        ShardedLoader(real_ds, **KINDS[kind], seed=7, rank=r, world_size=ranks, ranks_per_node=ranks, metrics=False)
        for r in range(ranks)
    ]
    for r, ld in enumerate(loaders):
        for step in range(len(ld)):
            for s in trace(ld, step, epoch=2)["samples"]:
                where = (r, step, s["row"], s["offset"], s["length"]) if packed else (r, step, s["length"])
                seen.setdefault(s["sample"], []).append(where)
    ld = loaders[1]  # any rank's loader answers for every sample
    for gid in range(len(ld.dataset)):
        got = find(ld, gid, epoch=2)
        flat = [
            (e["dp_rank"], e["step"], e["row"], e["offset"], e["length"])
            if packed
            else (e["dp_rank"], e["step"], e["length"])
            for e in got
        ]
        assert sorted(flat) == sorted(seen.get(gid, [])), gid
    # Named by key or by shard and index.
    t = trace(ld, 0, epoch=2)["samples"][0]
    assert sample_of(ld, key=t["key"]) == t["sample"] == sample_of(ld, shard=t["shard"], index=t["index"])
    with pytest.raises(ValueError, match="no sample has key"):
        sample_of(ld, key="no-such-key")
    with pytest.raises(ValueError, match="has .* samples, no #"):
        sample_of(ld, shard=t["shard"], index=10**6)
    for x in loaders:
        x.close()


def test_the_cli_finds_a_key(real_ds):
    from shardtool.loader.trace import find, sample_of

    ld = ShardedLoader(
        real_ds, seq_len=256, batch_size=4, seed=2, rank=0, world_size=2, ranks_per_node=2, metrics=False
    )
    key = trace(ld, 3)["samples"][0]["key"]
    want = find(ld, sample_of(ld, key=key))
    ld.close()
    args = ["trace", real_ds, "--key", key, "--ranks-per-node", "2", "--seq-len", "256", "--batch-size", "4"]
    out = subprocess.run(
        [sys.executable, "-m", "shardtool", *args, "--seed", "2", "--json"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["served"] == want and {"dp_rank": 0, "step": 3} in [{k: e[k] for k in ("dp_rank", "step")} for e in want]


def test_dump_writes_the_steps_as_the_loader_delivers_them(real_ds, tmp_path):
    kw = dict(seq_len=256, batch_size=4, seed=5, rank=1, world_size=2, ranks_per_node=2, metrics=False)
    ld = ShardedLoader(real_ds, num_workers=2, **kw)
    it = iter(ld)
    delivered = [next(it) for _ in range(7)]
    state = ld.state_dict()  # the run's checkpoint after step 6: dump goes back to steps 3..5
    ld.close()
    path = tmp_path / "state.json"
    path.write_text(json.dumps(state))
    args = ["trace", real_ds, "--step", "3:6", "--rank", "1", "--ranks-per-node", "2", "--seq-len", "256"]
    args += ["--batch-size", "4", "--seed", "5", "--state", str(path)]
    out = subprocess.run(
        [sys.executable, "-m", "shardtool", *args, "--dump", str(tmp_path / "d")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    for step in range(3, 6):
        stem = tmp_path / "d" / f"step-{step:08d}.rank-1"
        arrays = np.load(f"{stem}.npz")
        for name in ("input_ids", "labels", "position_ids", "cu_seqlens", "doc_offsets"):
            assert np.array_equal(arrays[name], delivered[step][name].numpy()), (step, name)
        meta = json.loads(open(f"{stem}.json").read())
        assert meta["fields"]["__key__"] == delivered[step]["__key__"] and meta["trace"]["step"] == step
    assert sorted(os.listdir(tmp_path / "d")) == sorted(
        f"step-{s:08d}.rank-1.{e}" for s in range(3, 6) for e in ("npz", "json")
    )
    span = subprocess.run(
        [sys.executable, "-m", "shardtool", *args, "--json"], capture_output=True, text=True, timeout=120
    )
    assert span.returncode == 0, span.stderr
    assert [t["step"] for t in json.loads(span.stdout)["steps"]] == [3, 4, 5]
    bad = subprocess.run(
        [sys.executable, "-m", "shardtool", *args[:2], "--step", "6:3", *args[4:]],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 1 and "0 <= A < B" in bad.stderr


def test_dump_of_a_mixtures_steps(real_ds, second_ds, tmp_path):
    from shardtool.loader.trace import dump
    from shardtool.plan.mixture import Mixture

    kw = dict(seq_len=512, batch_size=4, seed=2, steps=12, rank=0, world_size=1, metrics=False, num_workers=0)
    sources = {"lib": (real_ds, 0.5), "doc": (second_ds, 0.5)}
    delivered = list(ShardedLoader(Mixture(sources), **kw))
    dump(ShardedLoader(Mixture(sources), **kw), 4, 7, str(tmp_path))
    for step in range(4, 7):
        stem = tmp_path / f"step-{step:08d}.rank-0"
        assert np.array_equal(np.load(f"{stem}.npz")["input_ids"], delivered[step]["input_ids"].numpy())
        assert json.loads(open(f"{stem}.json").read())["fields"]["__source__"] == delivered[step]["__source__"]


@settings(max_examples=6, deadline=None)
@given(
    before=st.sampled_from([3, 2]),
    after=st.sampled_from([2, 4, 1]),
    fraction=st.floats(0.1, 0.8),
    skip=st.booleans(),
)
def test_find_follows_the_run_across_an_elastic_resume_and_skipped_steps(real_ds, before, after, fraction, skip):
    """A run on ``before`` ranks saves its state part-way, resumes on ``after`` (steps skipped
    too, maybe): every sample's entries from `find` on the resumed loader are exactly where the
    two runs served it (DP rank of the layout that served it, step of the epoch, piece)."""
    from shardtool.loader.trace import find

    kw = dict(seq_len=256, batch_size=4, seed=11, num_workers=0, metrics=False)
    seen: dict[str, list[tuple]] = {}
    state = None
    for rank in range(before):
        ld = ShardedLoader(real_ds, rank=rank, world_size=before, ranks_per_node=before, **kw)
        stop = max(1, int(len(ld) * fraction))
        for step, batch in zip(range(stop), ld):
            for row, key, offset, length in _delivered(batch, True):
                seen.setdefault(key, []).append((0, rank, step, row, offset, length))
        state = ld.state_dict() if rank == 0 else state
        ld.close()
    resumed = []
    for rank in range(after):
        ld = ShardedLoader(real_ds, rank=rank, world_size=after, ranks_per_node=after, **kw)
        ld.load_state_dict(json.loads(json.dumps(state)))
        start = len(ld) - ld.batches_left
        if skip and ld.batches_left > 3:
            ld.skip_steps(start + 1, start + 3)
        for step, batch in enumerate(ld, start=len(ld) - ld.batches_left):
            for row, key, offset, length in _delivered(batch, True):
                seen.setdefault(key, []).append((1 if after != before else 0, rank, step, row, offset, length))
        resumed.append(ld)
    ld = resumed[-1]
    ld.load_state_dict(json.loads(json.dumps(state)))  # the position after the resume, skips as given there
    if skip and len(ld) - ld.batches_left + 3 < len(ld):
        start = len(ld) - ld.batches_left
        ld.skip_steps(start + 1, start + 3)
    ds = shardtool.open_dataset(real_ds)
    offsets = np.cumsum([0, *ds.shard_counts])
    for gid in range(len(ds)):
        shard = int(np.searchsorted(offsets, gid, side="right")) - 1
        key = ds.read(shard, gid - int(offsets[shard]))["__key__"]
        got = [
            (e.get("segment", 0), e["dp_rank"], e["step"], e["row"], e["offset"], e["length"]) for e in find(ld, gid)
        ]
        assert sorted(got) == sorted(seen.get(key, [])), key
    for x in resumed:
        x.close()


@pytest.mark.parametrize("packed", [False, True])
def test_find_names_a_mixtures_steps_of_a_sample_on_every_rank(real_ds, second_ds, packed):
    """A mixture with a schedule, run long enough that a source starts its next epoch, then
    resumed under other weights: `find` on the resumed loader names exactly the steps (of its
    phase), DP ranks and rows where the resumed run served each sample of each source."""
    from shardtool.loader.trace import find

    size = dict(seq_len=1024, batch_size=16, steps=200) if packed else dict(max_tokens=65536, steps=90)
    kw = dict(size, seed=3, world_size=2, ranks_per_node=2, metrics=False, num_workers=0)
    sources = {"lib": (real_ds, 0.5), "doc": (second_ds, 0.5)}
    state = _state_after(ShardedLoader(Mixture(sources, max_repeat=50), rank=0, **kw), 10)
    changed = Mixture({"lib": (real_ds, 0.3), "doc": (second_ds, 0.7)}, schedule=[(50, {"lib": 0.6, "doc": 0.4})],
                      max_repeat=50)  # fmt: skip
    seen: dict[tuple[str, str], list[tuple]] = {}
    loaders = []
    for rank in range(2):
        ld = ShardedLoader(changed, rank=rank, **kw)
        ld.load_state_dict(json.loads(json.dumps(state)))
        for step, batch in enumerate(ld, start=10):
            for entry in _mixed(batch, packed):
                src, rest = entry[0], entry[1:]
                key = rest[1] if packed else rest[0]
                where = (rank, step, rest[0], rest[2], rest[3]) if packed else (rank, step)
                seen.setdefault((src, key), []).append(where)
        ld.load_state_dict(json.loads(json.dumps(state)))
        loaders.append(ld)
    ld = loaders[0]
    epochs = set()
    for name in ("lib", "doc"):
        ds = ld.datasets[name]
        offsets = np.cumsum([0, *ds.shard_counts])
        for gid in range(len(ds)):
            shard = int(np.searchsorted(offsets, gid, side="right")) - 1
            key = ds.read(shard, gid - int(offsets[shard]))["__key__"]
            got = find(ld, gid, source=name)
            flat = [(e["dp_rank"], e["step"], e["row"], e["offset"], e["length"]) if packed else (e["dp_rank"], e["step"])
                    for e in got]  # fmt: skip
            assert sorted(flat) == sorted(seen.get((name, key), [])), (name, key)
            epochs |= {e["source_epoch"] for e in got}
    assert len(epochs) > 1  # the run reached a source's next epoch
    with pytest.raises(ValueError, match="named with its source"):
        find(ld, 0)
    for x in loaders:
        x.close()


def test_the_cli_finds_a_key_in_a_mixture_file(real_ds, second_ds, tmp_path):
    from shardtool.loader.trace import find, sample_of

    spec = {"sources": {"lib": {"url": real_ds, "weight": 0.5}, "doc": {"url": second_ds, "weight": 0.5}}}
    path = tmp_path / "mix.json"
    path.write_text(json.dumps(spec))
    mix = Mixture.from_file(str(path))
    ld = ShardedLoader(mix, seq_len=512, batch_size=4, steps=30, seed=2, rank=0, world_size=2, ranks_per_node=2,
                       metrics=False, num_workers=0)  # fmt: skip
    t = trace(ld, 5)["samples"][0]
    want = find(ld, sample_of(ld, key=t["key"], source=t["source"]), source=t["source"])
    ld.close()
    args = ["trace", str(path), "--key", t["key"], "--steps", "30", "--ranks-per-node", "2", "--seq-len", "512"]
    out = subprocess.run(
        [sys.executable, "-m", "shardtool", *args, "--batch-size", "4", "--seed", "2", "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["served"] == want and {"source": t["source"], "sample": t["sample"]} in got["samples"]
    assert any(e["step"] == 5 and e["dp_rank"] == 0 for e in want)


@pytest.mark.parametrize("packed", [False, True])
def test_a_mixtures_skipped_steps_are_never_served_and_trace_follows_the_run(real_ds, second_ds, packed):
    """Issue 36: a mixture resumed at step 10 from a checkpoint before a loss spike, told to skip
    steps 15..19: steps 10..14 are the run's, from step 15 on each step takes what the same run
    served 5 steps later (the steps go on counting, the run still ends at step 40); trace and
    find answer for the run as it went, and a state saved after the skip resumes exactly."""
    from shardtool.loader.trace import find, sample_of

    size = dict(seq_len=512, batch_size=4) if packed else dict(max_tokens=65536)
    sources = {"lib": (real_ds, 0.6), "doc": (second_ds, 0.4)}
    for rank in (0, 1):
        kw = dict(size, seed=3, rank=rank, world_size=2, ranks_per_node=2, metrics=False, num_workers=0)
        longer = [_mixed(b, packed) for b in ShardedLoader(Mixture(sources, max_repeat=20), steps=45, **kw)]
        state = _state_after(ShardedLoader(Mixture(sources, max_repeat=20), steps=40, **kw), 10)
        again = ShardedLoader(Mixture(sources, max_repeat=20), steps=40, **kw)
        again.load_state_dict(state)
        for bad in ((9, 12), (15, 41), (20, 20)):
            with pytest.raises(ValueError, match="cannot skip steps"):
                again.skip_steps(*bad)
        again.skip_steps(15, 20)
        assert (len(again), again.batches_left) == (40, 30)  # the run's length is unchanged
        traced = [
            [(x["source"], *_traced({"samples": [x]}, packed)[0]) for x in trace(again, s)["samples"]]
            for s in range(10, 40)
        ]
        it = iter(again)
        got = [_mixed(next(it), packed) for _ in range(15)]  # steps 10..24
        mid = again.state_dict()
        got += [_mixed(b, packed) for b in it]
        assert got == [longer[t if t < 15 else t + 5] for t in range(10, 40)], rank
        assert traced == got
        assert mid["phase"]["skipped"] == [[15, 20]]
        # A state saved after the skip resumes with the run's next steps.
        resumed = ShardedLoader(Mixture(sources, max_repeat=20), steps=40, **kw)
        resumed.load_state_dict(mid)
        assert [_mixed(b, packed) for b in resumed] == got[15:]
        # find: a sample served at step 16 is found there; one only the skipped steps held is not.
        source, key = got[6][0][0], got[6][0][1 if not packed else 2]
        hits = find(resumed, sample_of(resumed, key=key, source=source), source=source)
        assert 16 in [h["step"] for h in hits]
        lost = {(e[0], e[1 if not packed else 2]) for t in range(15, 20) for e in longer[t]}
        lost -= {(e[0], e[1 if not packed else 2]) for g in longer[:15] + longer[20:] for e in g}
        assert lost  # samples only the skipped steps held
        for source, key in sorted(lost)[:3]:
            hits = find(resumed, sample_of(resumed, key=key, source=source), source=source)
            assert all(not 15 <= h["step"] < 20 for h in hits), (source, key, hits)
        resumed.close()
        if rank == 0:  # the same skip as a state edit: `shardtool state skip`
            path = os.path.join(str(real_ds) + f"-state-{int(packed)}.json")
            with open(path, "w") as f:
                json.dump({"loader": state}, f)
            cli = [sys.executable, "-m", "shardtool", "state"]
            out = subprocess.run(
                [*cli, "skip", path, "--key", "loader", "--steps", "15:20"], capture_output=True, text=True, timeout=120
            )
            assert out.returncode == 0, out.stderr
            shown = subprocess.run(
                [*cli, "show", path, "--key", "loader", "--json"], capture_output=True, text=True, timeout=120
            )
            assert json.loads(shown.stdout)["skipped"] == [[15, 20]]
            bad = subprocess.run(
                [*cli, "skip", path, "--key", "loader", "--steps", "12:13"], capture_output=True, text=True, timeout=120
            )
            assert bad.returncode != 0 and "after the last skip" in bad.stderr
            edited = ShardedLoader(Mixture(sources, max_repeat=20), steps=40, **kw)
            edited.load_state_dict(json.load(open(path))["loader"])
            assert [_mixed(b, packed) for b in edited] == got
            edited.close()
