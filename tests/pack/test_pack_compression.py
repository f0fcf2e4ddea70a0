"""Compressed Arrow shards (--compression zstd|lz4): the same samples through every reader."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import shardtool
from helpers.data_gen import pack_compressed_pairs
from shardtool import cache
from shardtool.format.errors import FormatError, ShardtoolError
from shardtool.loader import ShardedLoader
from shardtool.pack.inspection import inspect
from shardtool.pack.verify import verify
from shardtool.plan import Layout, Placement

pytestmark = pytest.mark.timeout(180)


def _rows(n: int = 3000) -> list[dict]:
    rng = np.random.default_rng(5)
    return [
        {
            "tokens": (rng.integers(0, 300, int(rng.integers(1, 120)))).astype(np.int32),
            "text": f"doc {i} " * (i % 9),
            "n": i,
            "blob": bytes(int(rng.integers(0, 200))),
            "meta": {"i": i, "even": i % 2 == 0},
        }
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    d = tmp_path_factory.mktemp("comp")
    rows = _rows()
    return rows, pack_compressed_pairs(rows, d, (None, "zstd", "lz4"), 200_000)


def _samples(url):
    return [
        {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in s.items()} for s in shardtool.open_dataset(url)
    ]


def test_compressed_shards_hold_the_same_samples_smaller(packed):
    rows, urls = packed
    plain = _samples(urls[None])
    assert [s["tokens"] for s in plain] == [r["tokens"].tolist() for r in rows]
    for comp in ("zstd", "lz4"):
        ds = shardtool.open_dataset(urls[comp])
        assert ds.manifest.compression == comp and ds.num_shards > 1
        assert _samples(urls[comp]) == plain
        assert ds.lengths.tolist() == shardtool.open_dataset(urls[None]).lengths.tolist()
        assert verify(urls[comp])["ok"]
        info = inspect(urls[comp], peek=True)
        assert info["compression"]["codec"] == comp and info["compression"]["ratio"] > 1.5
        assert info["compression"]["uncompressed_bytes"] > ds.manifest.num_bytes
    assert "compression" not in inspect(urls[None], peek=False)


def _batches(url, workers, **kw):
    ld = ShardedLoader(url, max_tokens=2048, seed=1, rank=0, world_size=1, num_workers=workers, **kw)
    return [{k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in b.items()} for b in ld]


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_reads_compressed_shards_identically(packed, workers):
    _, urls = packed
    want = _batches(urls[None], workers)
    assert len(want) > 10 and "tokens" in want[0]
    assert _batches(urls["zstd"], workers) == want
    assert _batches(urls["lz4"], workers) == want


def test_cache_warms_and_serves_compressed_shards(packed, tmp_path):
    _, urls = packed
    cdir = str(tmp_path / "cache")
    os.makedirs(os.path.dirname(cdir), exist_ok=True)
    report = cache.warm(urls["zstd"], cdir, placement=Placement(Layout(1, 1), 0), progress=False)
    assert report.exit_code == 0, report.summary()
    dc = cache.open_cache(urls["zstd"], cdir)
    assert all(dc.is_cached(i) for i in range(dc.dataset.num_shards))
    assert _batches(urls["zstd"], 0, cache_dir=cdir) == _batches(urls[None], 0)


def test_the_checksum_covers_the_compressed_batch(packed, tmp_path):
    import shutil

    _, urls = packed
    url = str(tmp_path / "damaged")
    shutil.copytree(urls["zstd"], url)
    ds = shardtool.open_dataset(url)
    idx = ds.shard_index(0)
    i = int(np.flatnonzero(idx.batch == 1)[0])  # the first sample of the second record batch
    off = int(idx.offsets[i]) + int(idx.sizes[i]) // 2
    with open(ds.shard_path(0), "r+b") as f:
        f.seek(off)
        byte = f.read(1)
        f.seek(off)
        f.write(bytes([byte[0] ^ 0xFF]))
    ds = shardtool.open_dataset(url)
    assert ds.read(0, 0)["n"] == 0  # another batch: still read
    with pytest.raises(FormatError, match=rf"sample #{i} .*checksum"):
        ds.read(0, i)
    bad = verify(url)["bad"]
    assert bad and any(s["index"] == i for s in bad[0]["samples"])


def test_compression_options_are_checked(tmp_path):
    rows = _rows(5)
    with pytest.raises(ShardtoolError, match="Arrow shards .*WebDataset"):
        shardtool.pack(rows, str(tmp_path / "a"), compression="zstd")
    with pytest.raises(ShardtoolError, match="must be one of zstd, lz4"):
        shardtool.pack(rows, str(tmp_path / "a"), format="arrow", compression="gzip")
    assert not os.path.exists(tmp_path / "a")
    shardtool.pack(rows, str(tmp_path / "b"), format="arrow", compression="none")
    assert shardtool.open_dataset(str(tmp_path / "b")).manifest.compression is None


def test_job_array_fragments_merge_into_a_compressed_dataset(tmp_path):
    from shardtool.pack import merge

    rows = _rows(400)
    out = str(tmp_path / "ds")
    for t in range(2):
        shardtool.pack(rows, out, format="arrow", compression="zstd", num_tasks=2, task_index=t, env={})
    merge(out)
    ds = shardtool.open_dataset(out)
    assert ds.manifest.compression == "zstd" and len(ds) == 400
    assert [s["n"] for s in ds] == list(range(400))


def _batch_rows(url: str) -> list[list[int]]:
    import pyarrow as pa

    ds = shardtool.open_dataset(url)
    out = []
    for s in range(ds.num_shards):
        r = pa.ipc.open_file(pa.memory_map(ds.shard_path(s)))
        out.append([r.get_batch(k).num_rows for k in range(r.num_record_batches)])
    return out


def test_compressed_record_batches_are_cut_at_1_mib_and_at_the_size_asked(tmp_path):
    """1 MiB compressed batches (Arrow decompresses each buffer with a fresh context: small
    batches decompress 4x slower), no 256-row cap below that; --record-batch-size sets it."""
    rows = [{"tokens": np.full(100, i, np.int32)} for i in range(12_000)]  # 400 payload bytes each
    out = {}
    for name, comp, size in (("plain", None, None), ("zstd", "zstd", None), ("small", "zstd", "64KiB")):
        out[name] = str(tmp_path / name)
        shardtool.pack(
            rows,
            out[name],
            format="arrow",
            length="tokens",
            shard_size="8MiB",
            compression=comp,
            record_batch_size=size,
        )
    per_batch = {name: [n for shard in _batch_rows(url) for n in shard] for name, url in out.items()}
    assert max(per_batch["plain"]) == 256
    # Cut by bytes (each sample counts its payload, here an npy file): 16x the rows of 64 KiB.
    assert max(per_batch["zstd"]) > 256 and abs(max(per_batch["zstd"]) / max(per_batch["small"]) - 16) < 0.2
    want = _samples(out["plain"])
    for name in ("zstd", "small"):
        assert _samples(out[name]) == want
        assert _batches(out[name], 0) == _batches(out["plain"], 0)
    with pytest.raises(ShardtoolError, match="record-batch-size applies to Arrow"):
        shardtool.pack(rows[:5], str(tmp_path / "tar"), record_batch_size="1MiB")


def test_pack_cli_record_batch_size(tmp_path):
    from helpers.data_gen import write_jsonl
    from helpers.runcli import shardtool_cli

    src = write_jsonl(str(tmp_path / "in.jsonl"), [{"tokens": list(range(i % 50 + 1))} for i in range(3000)])
    out = str(tmp_path / "ds")
    r = shardtool_cli(
        "pack", src, "-o", out, "--format", "arrow", "--compression", "zstd", "--length", "tokens",
        "--record-batch-size", "16KiB", "-q", timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert len(_batch_rows(out)[0]) > 1 and _samples(out)[5]["tokens"] == list(range(6))
