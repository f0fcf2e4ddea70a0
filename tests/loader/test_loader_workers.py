"""Worker processes: failures surface fast and name the data; payloads cross as tensors."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from shardtool.format import FieldSpec, FormatError, Manifest, ShardFileWriter, publish_manifest
from shardtool.loader import LoaderError, ShardedLoader
from shardtool.loader.collate import PackedBytes
from shardtool.loader.reader import BatchReader
from shardtool.loader.source import SourceSpec
from test_loader_data import read_all, write_dataset


@pytest.mark.timeout(60)
def test_a_worker_that_raises_names_the_sample(tmp_path):
    root, keys = write_dataset(str(tmp_path / "d"), [20, 20])
    bad = keys[17]

    def transform(sample):
        if sample["__key__"] == bad:
            raise ValueError("boom")
        return sample

    began = time.monotonic()
    with pytest.raises(ValueError) as info:
        read_all(ShardedLoader(root, batch_size=4, num_workers=2, transform=transform))
    assert time.monotonic() - began < 20
    assert str(info.value) == "boom"  # the user's exception as it was raised; where, in its notes
    notes = "\n".join(info.value.__notes__)
    assert bad in notes and "shard-00000.tar" in notes


def _die(sample):
    if sample["__key__"] == "s000021":
        os.kill(os.getpid(), signal.SIGKILL)
    return sample


@pytest.mark.timeout(60)
def test_a_killed_worker_is_an_error_within_seconds(tmp_path):
    root, _ = write_dataset(str(tmp_path / "d"), [20, 20])
    began = time.monotonic()
    with pytest.raises(LoaderError) as info:
        read_all(ShardedLoader(root, batch_size=4, num_workers=2, transform=_die))
    assert time.monotonic() - began < 20
    msg = str(info.value)
    assert "batch" in msg and "shard-0000" in msg and ("killed" in msg.lower() or "exited" in msg.lower())


@pytest.mark.timeout(60)
def test_a_truncated_shard_names_the_shard(tmp_path):
    root, _ = write_dataset(str(tmp_path / "d"), [20, 20])
    path = os.path.join(root, "shard-00001.tar")
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(FormatError, match="shard-00001.tar"):
        read_all(ShardedLoader(root, batch_size=4, num_workers=2))


def _binary_dataset(root: str, sizes: list[int]) -> list[bytes]:
    os.makedirs(root, exist_ok=True)
    fields = [FieldSpec.raw("bin")]
    rng = np.random.default_rng(0)
    payloads = [
        rng.integers(0, 256, size=int(rng.integers(50_000, 150_000)), dtype=np.uint8).tobytes()
        for _ in range(sum(sizes))
    ]
    infos, lens, g = [], [], 0
    for s, n in enumerate(sizes):
        w = ShardFileWriter(root, f"img-{s}.tar", "tar", fields)
        for _ in range(n):
            w.add(f"k{g:04d}", [payloads[g]], len(payloads[g]))
            g += 1
        info, ln = w.finish()
        infos.append(info)
        lens.append(ln)
    publish_manifest(
        root, Manifest("tar", fields, infos, {"field": None, "unit": "bytes", "fn": None}), np.concatenate(lens)
    )
    return payloads


@pytest.mark.timeout(60)
def test_large_binary_payloads_cross_as_one_shared_tensor(tmp_path):
    root = str(tmp_path / "img")
    payloads = _binary_dataset(root, [6, 6])
    reader = BatchReader(SourceSpec(root))
    packed = reader.read_batch(np.arange(4), pack=True)
    assert isinstance(packed["bin"], PackedBytes) and packed["bin"].unpack() == payloads[:4]
    by_key = {f"k{i:04d}": p for i, p in enumerate(payloads)}
    for nw in (0, 2):
        got = {}
        for b in ShardedLoader(root, batch_size=3, num_workers=nw):
            assert "lengths" in b and "bin" in b
            got.update(zip(b["__key__"], b["bin"]))
        assert got == by_key


@pytest.mark.timeout(60)
def test_one_map_per_shard_per_process(tmp_path):
    root, _ = write_dataset(str(tmp_path / "d"), [10, 10, 10])
    ld = ShardedLoader(root, batch_size=2, num_workers=0)
    read_all(ld)
    assert sorted(ld.reader.store.views) == [0, 1, 2]
    maps = [line for line in open("/proc/self/maps") if root in line]
    assert len({line.split()[-1] for line in maps}) == 3
