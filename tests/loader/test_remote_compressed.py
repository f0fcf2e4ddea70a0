"""Ranged remote reads of a compressed Arrow dataset without a node cache (issue #25, item 2).

Each record batch is fetched by range at most about once per pass per process and kept
decompressed (loader/batchcache.py), instead of fetched whole again by every training batch that
touches it. Served through a real S3 API (moto, via s3fs); the bytes fetched are counted at the
source, by a TCP proxy in front of the server that counts every byte it sends back.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import threading

import numpy as np
import pytest
import torch

from helpers.data_gen import pack_compressed_pairs
from helpers.realtext import stdlib_files
from helpers.s3server import s3_server  # noqa: F401  (fixture)
from shardtool.format import FormatError, open_dataset
from shardtool.loader import ShardedLoader
from shardtool.loader.batchcache import CompressedBatches

pytestmark = pytest.mark.timeout(300)


def _chunks() -> list[bytes]:
    """Real text in ~2 KB pieces (paragraphs of stdlib sources), the sample size the README's
    numbers are about."""
    out = []
    for p in stdlib_files(subdirs=("asyncio", "email")):
        with open(p, "rb") as f:
            text = f.read()
        piece = b""
        for para in re.split(rb"\n\s*\n", text):
            piece += para + b"\n\n"
            if len(piece) >= 2000:
                out.append(piece)
                piece = b""
        if piece:
            out.append(piece)
    return [p[k : k + 4000] for p in out for k in range(0, len(p), 4000)]  # a long paragraph cut


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    d = tmp_path_factory.mktemp("remotezstd")
    rows = [
        {"tokens": np.frombuffer(c, np.uint8).astype(np.uint16), "src": f"piece {i}", "n": i}
        for i, c in enumerate(_chunks())
    ]
    return pack_compressed_pairs(rows, d, (None, "zstd"), 300_000)


def _stored_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)


class CountingProxy:
    """A TCP proxy to ``port`` on 127.0.0.1 that counts the bytes the server sends back."""

    def __init__(self, port: int):
        self.target = port
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.down = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return  # closed
            server = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, count: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if count:
                    with self._lock:
                        self.down += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


def _batches(url, workers=0, **kw):
    ld = ShardedLoader(url, max_tokens=8192, seed=3, rank=0, world_size=1, num_workers=workers, **kw)
    out = [{k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in b.items()} for b in ld]
    return out, ld


def test_a_shuffled_remote_pass_fetches_each_record_batch_about_once(packed, s3_server):  # noqa: F811
    url = s3_server.upload(packed["zstd"], "remotezstd/once")
    stored = _stored_bytes(packed["zstd"])
    ds = open_dataset(packed["zstd"])
    shard_bytes = sum(s.bytes for s in ds.manifest.shards)
    batches_in_dataset = sum(int(ds.shard_index(s).batch.max()) + 1 for s in range(ds.num_shards))
    assert ds.num_shards > 1 and batches_in_dataset > 10
    want, _ = _batches(packed[None])
    assert len(want) > 20  # many training batches, each touching most record batches' samples
    proxy = CountingProxy(s3_server.port)
    try:
        opts = {**s3_server.storage_options}
        opts["client_kwargs"] = {**opts["client_kwargs"], "endpoint_url": f"http://127.0.0.1:{proxy.port}"}
        before = CompressedBatches.decompressed
        got, ld = _batches(url, storage_options=opts)
        fetched = proxy.down
    finally:
        proxy.close()
    assert got == want  # the same samples, batches and order as the plain dataset read locally
    assert CompressedBatches.decompressed - before == batches_in_dataset  # each decompressed once
    # Everything the store sent (shards, indexes, manifest, lengths, HTTP headers) against the
    # dataset's stored size: about once, where one fetch per training batch was ~len(want) times.
    assert fetched <= 1.2 * stored, (fetched, stored)
    assert ld.metrics()["cumulative"]["bytes_read"]["remote"] == shard_bytes - _headers(ds)


def test_a_remote_share_of_more_shards_than_maps_kept_fetches_each_record_batch_once(packed, s3_server):  # noqa: F811
    """Local views are closed beyond MAX_OPEN_SHARDS (maps); remote ones hold no map and keep
    their decompressed batches, so a share of many shards is still fetched about once a pass."""
    url = s3_server.upload(packed["zstd"], "remotezstd/views")
    ds = open_dataset(packed["zstd"])
    batches_in_dataset = sum(int(ds.shard_index(s).batch.max()) + 1 for s in range(ds.num_shards))
    want, _ = _batches(packed[None])
    ld = ShardedLoader(
        url,
        max_tokens=8192,
        seed=3,
        rank=0,
        world_size=1,
        num_workers=0,
        storage_options=s3_server.storage_options,
    )
    ld.reader.ctx.max_open = 1  # fewer than the dataset's shards, which every shuffled batch touches
    before = CompressedBatches.decompressed
    got = [{k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in b.items()} for b in ld]
    assert got == want
    assert CompressedBatches.decompressed - before == batches_in_dataset


def _headers(ds) -> int:
    """Bytes of the shards that are no record batch (each file's footer; the first batch's range
    starts at the file's beginning): what the loader never fetches by range."""
    total = 0
    for s in range(ds.num_shards):
        idx = ds.shard_index(s)
        _, first = np.unique(idx.batch, return_index=True)
        total += ds.manifest.shards[s].bytes - int(idx.sizes[first].sum())
    return total


@pytest.mark.parametrize("workers", [2])
def test_remote_compressed_reads_match_plain_with_workers(packed, workers, s3_server):  # noqa: F811
    url = s3_server.upload(packed["zstd"], "remotezstd/workers")
    want, _ = _batches(packed[None], workers)
    got, _ = _batches(url, workers, storage_options=s3_server.storage_options)
    assert got == want


def test_a_flipped_byte_in_a_remote_record_batch_is_refused_naming_it(packed, tmp_path, s3_server):  # noqa: F811
    bad = str(tmp_path / "bad")
    shutil.copytree(packed["zstd"], bad)
    ds = open_dataset(bad)
    idx = ds.shard_index(1)
    path = os.path.join(bad, ds.manifest.shards[1].path)
    at = int(idx.offsets[0]) + int(idx.sizes[0]) // 2
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(FormatError, match=rf"shard {ds.manifest.shards[1].path} sample #\d+.*checksum"):
        _batches(s3_server.upload(bad, "remotezstd/bad"), storage_options=s3_server.storage_options)


def test_a_remote_share_larger_than_the_batches_kept_is_warned_about_and_still_read(packed, s3_server):  # noqa: F811
    """The same budget and warning as reads in place: a share that does not fit is refetched, not misread."""
    url = s3_server.upload(packed["zstd"], "remotezstd/small")
    cls = CompressedBatches
    saved = cls._cap, cls.CACHE_BYTES, cls._warned
    cls._cap = cls.CACHE_BYTES = 1 << 16
    cls._warned = False
    try:
        with pytest.warns(RuntimeWarning, match="exceeds the decompressed record batches.*cache_dir"):
            got, _ = _batches(url, storage_options=s3_server.storage_options)
    finally:
        cls._cap, cls.CACHE_BYTES, cls._warned = saved
    assert got == _batches(packed[None])[0]
