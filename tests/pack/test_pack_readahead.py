"""One read-ahead thread per packing job over all its Parquet units (worker._read_ahead): the next
row group decodes while this one is written. It must change nothing but the time: same bytes, an
unreadable row group skipped (or raised) at its place, and no thread left behind on an error."""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import shardtool
from helpers.realtext import byte_ids, stdlib_files
from shardtool.format.errors import BadSampleError

ROWS = 40  # per row group: several units, so the reader runs ahead of the writer


def _write(path: str, files: list[str]) -> list[np.ndarray]:
    docs = [byte_ids(p)[:20_000] for p in files]
    col = pa.array([d.tolist() for d in docs], type=pa.list_(pa.int32()))
    pq.write_table(pa.table({"tokens": col, "name": [os.path.basename(p) for p in files]}), path, row_group_size=ROWS)
    return docs


def _corrupt_row_group(path: str, group: int) -> None:
    """Overwrite the middle of one row group's column chunk (the file's footer stays readable)."""
    md = pq.ParquetFile(path).metadata.row_group(group).column(0)
    start = md.dictionary_page_offset or md.data_page_offset
    with open(path, "r+b") as f:
        f.seek(start + md.total_compressed_size // 2)
        f.write(b"\xff" * 64)


def _threads() -> int:
    return sum(t.name == "shardtool-prefetch" and t.is_alive() for t in threading.enumerate())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["tar", "arrow"])
def test_read_ahead_packs_every_row_group_in_order(tmp_path, fmt):
    files = stdlib_files(300)
    a = _write(str(tmp_path / "a.parquet"), files[:170])
    b = _write(str(tmp_path / "b.parquet"), files[170:])
    out = str(tmp_path / "ds")
    r = shardtool.pack(
        [str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")], out, format=fmt, length="tokens", shard_size="2MB"
    )
    assert r.samples == 300 and not r.skipped
    lengths = np.load(os.path.join(out, "lengths.npy"))
    assert lengths.tolist() == [len(d) for d in a + b]
    with open(os.path.join(out, "index.json")) as f:
        assert len(json.load(f)["shards"]) > 1
    assert _threads() == 0


@pytest.mark.timeout(120)
def test_an_unreadable_row_group_is_skipped_in_place_or_named(tmp_path):
    files = stdlib_files(200)
    docs = _write(str(tmp_path / "a.parquet"), files)
    _corrupt_row_group(str(tmp_path / "a.parquet"), 2)
    src = str(tmp_path / "a.parquet")
    with pytest.raises(BadSampleError, match=r"a\.parquet"):
        shardtool.pack(src, str(tmp_path / "strict"), length="tokens")
    assert _threads() == 0
    assert not os.path.exists(os.path.join(tmp_path, "strict", "index.json"))
    r = shardtool.pack(src, str(tmp_path / "ds"), length="tokens", skip_bad=True)
    assert len(r.skipped) == 1 and "a.parquet" in r.skipped[0]
    kept = [d for i, d in enumerate(docs) if i // ROWS != 2]
    assert r.samples == len(kept)
    assert np.load(os.path.join(tmp_path, "ds", "lengths.npy")).tolist() == [len(d) for d in kept]
    assert _threads() == 0
