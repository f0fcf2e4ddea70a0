"""The columnar path writes exactly the bytes the sample-by-sample path writes (tar and Arrow)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shardtool
from helpers.data_gen import dir_digest
from shardtool.format.tarshard import _header_slow, headers_batch
from shardtool.pack import columns, fastcol


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.binary(min_size=1, max_size=100).filter(lambda b: b"\x00" not in b), st.integers(0, 8**11 - 1)),
        min_size=1,
        max_size=8,
    )
)
def test_headers_batch_matches_reference(members):
    width = len(members[0][0])
    members = [(n[:width].ljust(width, b"a"), s) for n, s in members]
    names = np.frombuffer(b"".join(n for n, _ in members), dtype=np.uint8).reshape(len(members), width)
    got = headers_batch(names, np.array([s for _, s in members], dtype=np.int64))
    for row, (name, size) in zip(got, members):
        assert row.tobytes() == _header_slow(name, size, b"0")


def _table(n: int, seed: int, nulls: bool) -> pa.Table:
    rng = np.random.default_rng(seed)
    lens = rng.integers(0, 40, n)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    toks = pa.ListArray.from_arrays(
        pa.array(offsets), pa.array(rng.integers(-5, 1000, int(offsets[-1]), dtype=np.int32))
    )
    floats = pa.ListArray.from_arrays(pa.array(offsets), pa.array(rng.random(int(offsets[-1]), dtype=np.float32)))
    text = [("é" * int(k)) + f"doc-{i}" for i, k in enumerate(rng.integers(0, 5, n))]
    blobs = [rng.bytes(int(k)) for k in rng.integers(0, 700, n)]
    ids = rng.integers(-(10**12), 10**12, n)
    if nulls:
        text[n // 2] = None  # one batch must fall back to the row path (and skip this sample)
    return pa.table(
        {
            "tokens": toks,
            "emb": floats,
            "text": pa.array(text, pa.string()),
            "blob": pa.array(blobs),
            "id": pa.array(ids),
        }
    )


@pytest.mark.parametrize("fmt", ["tar", "arrow"])
@pytest.mark.parametrize(
    "opts",
    [
        dict(length="tokens"),
        dict(),
        dict(length="text", shard_size=20_000),
        dict(length="id", samples_per_shard=7, skip_bad=True),
        dict(length="tokens", shard_size=9_000, workers=2),
        dict(length="tokens", key="name", shard_size=30_000),
        dict(length="tokens", max_length=30),
    ],
)
@pytest.mark.timeout(120)
def test_fast_path_is_byte_identical(tmp_path, monkeypatch, opts, fmt):
    src = str(tmp_path / "in.parquet")
    table = _table(300, 1, nulls="skip_bad" in opts)
    if opts.get("length") == "id":
        table = table.set_column(4, "id", pa.array(np.abs(table.column("id").to_numpy())))
    if "key" in opts:
        table = table.append_column("name", pa.array([f"doc-{i:05d}" for i in range(table.num_rows)]))
    pq.write_table(table, src, row_group_size=64)
    fast = shardtool.pack(src, str(tmp_path / "fast"), format=fmt, **opts)
    monkeypatch.setattr(columns.ColumnShaper, "shape", lambda self, *a, **k: None)
    slow = shardtool.pack(src, str(tmp_path / "slow"), format=fmt, **opts)
    assert fast.samples == slow.samples and fast.skipped == slow.skipped and fast.dropped == slow.dropped
    assert dir_digest(str(tmp_path / "fast")) == dir_digest(str(tmp_path / "slow"))


def test_fast_path_takes_clean_batches():
    from shardtool.format.fields import infer_field
    from shardtool.pack.readers import _column_values

    batch = _table(50, 2, nulls=False).to_batches()[0]
    first = {n: _column_values(batch.column(n))[0] for n in batch.schema.names}
    fields = [infer_field(n, v) for n, v in first.items()]
    sb = columns.ColumnShaper(fields, key_field=None, length_field="tokens", key_width=9).shape(batch, np.arange(50))
    assert sb is not None and len(sb) == 50
    enc = fastcol.TarEncoder(fields, shard_size=None).encode(sb)
    assert enc is not None and len(enc) == 50 and enc.keys[0].as_py() == "000000000"


@pytest.mark.timeout(30)
def test_prefetch_keeps_order_errors_and_stops_early():
    import threading

    from shardtool.pack.prefetch import prefetch

    assert list(prefetch(iter(range(100)))) == list(range(100))

    def failing():
        yield 1
        yield 2
        raise ValueError("third")

    got = []
    with pytest.raises(ValueError, match="third"):
        for x in prefetch(failing()):
            got.append(x)
    assert got == [1, 2]
    before = threading.active_count()
    it = prefetch(iter(range(10**9)))
    assert next(it) == 0
    it.close()  # the consumer stops early: the reading thread must end too
    assert threading.active_count() == before
