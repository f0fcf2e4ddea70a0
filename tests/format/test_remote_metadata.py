"""What a rank reads of a remote dataset before its first batch, read in fewer waits: the schema
from one read of a shard's tail, the lengths range beside the lengths file's header. Both are
checked here on real packed files (stdlib source as byte ids), in every layout they may meet."""

from __future__ import annotations

import os

import fsspec
import numpy as np
import pytest

import shardtool
from helpers.realtext import byte_ids, stdlib_files
from helpers.s3server import s3_server  # noqa: F401  (fixture)
from shardtool.format import FormatError, open_dataset
from shardtool.format.arrowshard import schema_for, schema_from_tail
from shardtool.format.lengthsfile import read_lengths_range


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("meta") / "ds")
    rows = [{"tokens": byte_ids(p), "path": os.path.relpath(p)} for p in stdlib_files(60)]
    shardtool.pack(rows, root, format="arrow", length="tokens", shard_size=2_000_000)
    return open_dataset(root)


class Reads:
    """``read(start, end)`` of one local file, each call recorded."""

    def __init__(self, path: str):
        self.path, self.calls = path, []

    def __call__(self, start: int, end: int) -> bytes:
        self.calls.append((start, end))
        with open(self.path, "rb") as f:
            f.seek(start)
            return f.read(end - start)


def test_the_schema_comes_from_one_read_of_the_tail_and_equals_the_files(packed):
    import pyarrow as pa

    info = packed.manifest.shards[1]
    path = packed.shard_path(1)
    reads = Reads(path)
    got = schema_from_tail(reads, info.bytes, packed.manifest.fields, info.path)
    assert got.equals(pa.ipc.open_file(path).schema) and got.equals(schema_for(packed.manifest.fields))
    assert reads.calls == [(max(0, info.bytes - (64 << 10)), info.bytes)]
    # a footer longer than the tail read: once more, for exactly the footer and trailer
    short = Reads(path)
    assert schema_from_tail(short, info.bytes, packed.manifest.fields, info.path, tail=32).equals(got)
    assert len(short.calls) == 2 and short.calls[1][1] == info.bytes and short.calls[1][0] < info.bytes - 32


def test_a_cut_or_foreign_shard_is_named_in_the_error(packed, tmp_path):
    info = packed.manifest.shards[0]
    data = open(packed.shard_path(0), "rb").read()
    cut = tmp_path / "cut.arrow"
    cut.write_bytes(data[:-100])
    with pytest.raises(FormatError, match=f"{info.path}: not a readable Arrow IPC file"):
        schema_from_tail(Reads(str(cut)), len(data) - 100, packed.manifest.fields, info.path)
    other = [f for f in packed.manifest.fields if f.name != "path"]
    with pytest.raises(FormatError, match=f"{info.path}: Arrow schema disagrees with the manifest"):
        schema_from_tail(Reads(packed.shard_path(0)), len(data), other, info.path)


@pytest.mark.parametrize("store", ["local", "s3"])
@pytest.mark.parametrize("layout", ["ours", "int32", "size unknown", "size wrong"])
def test_lengths_ranges_equal_the_whole_file_in_every_layout(packed, tmp_path, layout, store, request):
    """The range is read where our int64 layout would put it, beside the header (on a store,
    where a read waits: a real S3 API); any other layout (another writer's int32, a size the
    manifest does not give or gives wrong) is read again where the header says: the values are
    the same either way, and locally."""
    whole = packed.lengths
    n = len(whole)
    path = str(tmp_path / "lengths.npy")
    np.save(path, whole.astype(np.int32 if layout == "int32" else np.int64))
    size = {"size unknown": None, "size wrong": os.path.getsize(path) + 8}.get(layout, os.path.getsize(path))
    fs = fsspec.filesystem("file")
    if store == "s3":
        server = request.getfixturevalue("s3_server")
        bucket = "lengths-" + layout.replace(" ", "-")
        path = server.upload(str(tmp_path), bucket).removeprefix("s3://") + "/lengths.npy"
        fs = server.fs()
    for lo, hi in [(0, n), (0, 1), (n - 1, n), (n // 3, 2 * n // 3), (5, 5), (0, 0)]:
        got = read_lengths_range(fs, path, n, lo, hi, "ds", size)
        assert got.dtype == np.int64 and got.tolist() == whole[lo:hi].tolist(), (lo, hi)
    with pytest.raises(FormatError, match="expected 7 integer lengths"):
        read_lengths_range(fs, path, 7, 0, 7, "ds", size)
    with pytest.raises(ValueError, match="outside"):
        read_lengths_range(fs, path, n, 0, n + 1, "ds", size)


def test_s3_clients_share_the_processs_session_and_a_forked_child_reuses_it(packed, request):
    """A forked loader worker makes its S3 client from the session the rank's process parsed the
    service models into (`s3_session`); the dataset's filesystem still pickles, into another
    process's own session; a session or profile the user gives is theirs."""
    import pickle

    from shardtool.format.storage import dataset_fs, s3_session

    server = request.getfixturevalue("s3_server")
    url = server.upload(packed.root, "session-share/ds")
    opts = server.storage_options
    fs, root = dataset_fs(url, opts)
    assert fs.session is s3_session()
    first = sorted(fs.ls(root))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a loader worker: the same session object, and reads that work
        os.close(r)
        child, _ = dataset_fs(url, opts)
        ok = child.session is s3_session() and sorted(child.ls(root)) == first
        os.write(w, b"ok" if ok else b"no")
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    assert os.read(r, 2) == b"ok"
    again = pickle.loads(pickle.dumps(fs))
    assert again.session is s3_session() and sorted(again.ls(root)) == first
    from aiobotocore.session import AioSession

    mine = AioSession()
    assert dataset_fs(url, {**opts, "session": mine})[0].session is mine
    assert open_dataset(url, storage_options=opts).manifest == packed.manifest
