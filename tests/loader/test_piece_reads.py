"""Packed rows read a piece of a document, and only a piece is fetched and counted.

Real text: the stdlib's .py files as byte ids (uint16 tokens), packed as tar shards with a key
column, as `shardtool pack stdlib.parquet -o ds --length tokens --key id` packs them. Most files
are longer than a 256-token row, a few over 100k: a long document is split into hundreds of
pieces spread over the pass.

- A remote tar dataset read without a cache fetched the whole document for every piece
  (300 batches of 1.2 MB of tokens fetched 400 MB); now each piece is fetched by range. Served by
  a real S3 API (moto), the bytes counted at the source by the proxy in front of it.
- `metrics()["cumulative"]["bytes_read"]` counted each piece as its whole document (200 batches of
  0.8 MB of tokens: 264 MB); now a piece's bytes.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import shardtool
from helpers.realtext import byte_ids, stdlib_files
from helpers.s3proxy import s3_proxy  # noqa: F401  (fixture)
from helpers.s3server import s3_server  # noqa: F401  (fixture)
from helpers.skips import require
from shardtool.loader import ShardedLoader

SEQ, ROWS = 256, 8
LOADER = dict(seq_len=SEQ, batch_size=ROWS, num_workers=0, seed=0, rank=0, world_size=1)


@pytest.fixture(scope="module")
def stdlib_tar(tmp_path_factory) -> str:
    """The stdlib's .py files as uint16 byte ids, one tar shard set with an ``id`` key."""
    paths = stdlib_files()
    require(len(paths) >= 500, "too few stdlib files here")
    rows = [{"id": f"f{i:05d}", "tokens": byte_ids(p).astype(np.uint16)} for i, p in enumerate(paths)]
    root = str(tmp_path_factory.mktemp("pieces") / "ds")
    shardtool.pack(rows, root, format="tar", length="tokens", key="id")
    return root


def read(url: str, batches: int, **kw) -> tuple[list[dict], dict]:
    """The first ``batches`` batches (tensors as lists) and the loader's cumulative metrics."""
    ld = ShardedLoader(url, **LOADER, **kw)
    out = [{k: v.tolist() if hasattr(v, "tolist") else v for k, v in b.items()} for b in itertools.islice(ld, batches)]
    return out, ld.metrics()["cumulative"]


def served_bytes(batches: list[dict]) -> int:
    """The token bytes the batches hold (uint16: 2 bytes a token)."""
    return 2 * sum(sum(b["lengths"]) for b in batches)


@pytest.mark.timeout(120)
def test_remote_tar_fetches_the_pieces_not_the_documents(stdlib_tar, s3_server, s3_proxy):  # noqa: F811
    url = s3_server.upload(stdlib_tar, "pieces/ds")
    local, _ = read(stdlib_tar, 12)
    s3_proxy.reset()
    remote, metrics = read(url, 12, storage_options=s3_proxy.storage_options)
    assert remote == local  # the same tokens, keys, offsets and boundaries
    served = served_bytes(remote)
    fetched = sum(n for k, n in s3_proxy.counts().bytes_by_key.items() if k.endswith(".tar"))
    # Each piece's range, whole short documents with their tar header; before: ~250x the tokens.
    assert served <= fetched <= 3 * served, (served, fetched)
    assert fetched <= metrics["bytes_read"]["remote"] <= 3 * served + 200_000  # + the sample indexes


@pytest.mark.timeout(60)
@pytest.mark.parametrize("outputs", ["full", "lean"])
def test_bytes_read_count_the_pieces(stdlib_tar, outputs):
    batches, metrics = read(stdlib_tar, 100, packed_outputs=outputs)
    served = served_bytes(batches)
    counted = metrics["bytes_read"]["local"]
    # Exactly the pieces' tokens (no eos is added); before: the whole document per piece, ~300x.
    assert served <= counted <= 1.05 * served, (served, counted)
