"""`Decompressor`, the one path by which the cache, a rank's memory and record-batch reads get a
compressed Arrow shard's values plain: same batches row for row, any thread count, the shard
named in every failure."""

from __future__ import annotations

import os
import sysconfig
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pytest

from shardtool.format import FormatError
from shardtool.format.decompress import Decompressor, range_batch


def _stdlib_file(tmp_path, codec: str | None = "zstd") -> bytes:
    """An Arrow IPC file of the stdlib's .py sources, 40 per record batch, ``codec``-compressed."""
    root = sysconfig.get_paths()["stdlib"]
    paths = sorted(os.path.join(d, n) for d, _, files in os.walk(root) for n in files if n.endswith(".py"))[:400]
    names = [os.path.relpath(p, root) for p in paths]
    texts = [open(p, "rb").read() for p in paths]
    schema = pa.schema([("__key__", pa.string()), ("text", pa.binary())])
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression=codec) if codec else None
    with pa.ipc.new_file(sink, schema, options=options) as writer:
        for i in range(0, len(names), 40):
            writer.write_batch(pa.record_batch([pa.array(names[i : i + 40]), pa.array(texts[i : i + 40])], schema))
    return sink.getvalue().to_pybytes()


def _batches(data) -> list[pa.RecordBatch]:
    reader = pa.ipc.open_file(pa.py_buffer(data))
    return [reader.get_batch(k) for k in range(reader.num_record_batches)]


@pytest.mark.parametrize("threads", [0, 3])
def test_the_plain_file_keeps_every_record_batch_row_for_row(tmp_path, threads):
    data = _stdlib_file(tmp_path)
    with ThreadPoolExecutor(max(threads, 1)) as pool:
        sink = pa.BufferOutputStream()
        rows = Decompressor(data, "shard 0").write_plain(sink, pool if threads else None)
    plain = sink.getvalue().to_pybytes()
    assert rows == [b.num_rows for b in _batches(data)] and sum(rows) == 400
    assert [b.equals(c) for b, c in zip(_batches(plain), _batches(data))] == [True] * len(rows)
    assert len(plain) > 2 * len(data)  # the stdlib's text compresses well: the buffers are now plain
    one = pa.BufferOutputStream()
    Decompressor(data, "shard 0").write_plain(one)
    assert one.getvalue().to_pybytes() == plain  # the same bytes whatever the threads


def test_batches_come_back_in_the_order_asked_on_any_thread_count(tmp_path):
    data = _stdlib_file(tmp_path)
    dec = Decompressor(data, "shard 0")
    want = [7, 2, 9, 0, 3, 3, 5]
    assert dec.count == 10
    with ThreadPoolExecutor(3) as pool:
        for threads in (1, 2, 3):
            got = dec.batches(want, pool, threads)
            assert [b.column(0)[0].as_py() for b in got] == [dec.batch(k).column(0)[0].as_py() for k in want]


class _Pause:
    def __init__(self, at: list[int], sink: pa.BufferOutputStream, stop_at: int | None = None):
        self.asked, self.at, self.sink, self.stop_at, self.quiet_at = 0, at, sink, stop_at, []

    def wanted(self) -> bool:
        self.asked += 1
        if self.asked == self.stop_at:
            raise KeyboardInterrupt
        return self.asked in self.at

    def quiet(self) -> None:
        self.quiet_at.append(self.sink.tell())


def test_a_pause_gets_its_quiet_moment_and_may_stop_the_rewrite(tmp_path):
    data = _stdlib_file(tmp_path)
    with ThreadPoolExecutor(2) as pool:
        sink = pa.BufferOutputStream()
        pause = _Pause([3, 6], sink)
        Decompressor(data, "shard 0").write_plain(sink, pool, pause)
        assert len(pause.quiet_at) == 2 and pause.quiet_at[0] < pause.quiet_at[1]
        assert sink.getvalue().to_pybytes() == _plain(data)  # pausing changes no byte
        stopped = pa.BufferOutputStream()
        with pytest.raises(KeyboardInterrupt):
            Decompressor(data, "shard 0").write_plain(stopped, pool, _Pause([], stopped, stop_at=4))


def _plain(data) -> bytes:
    sink = pa.BufferOutputStream()
    Decompressor(data, "x").write_plain(sink)
    return sink.getvalue().to_pybytes()


def test_a_damaged_shard_is_named_with_its_record_batch(tmp_path):
    data = bytearray(_stdlib_file(tmp_path))
    with pytest.raises(FormatError, match="shard 7: not a readable Arrow IPC file"):
        Decompressor(b"not an arrow file at all, but long enough", "shard 7")
    body = bytes(data).index(b"\x28\xb5\x2f\xfd", 64)  # the first zstd frame: one of batch 0's buffers
    data[body : body + 4] = b"\0\0\0\0"
    dec = Decompressor(bytes(data), "shard 7")
    with pytest.raises(FormatError, match="shard 7: record batch 0 cannot be decompressed"):
        dec.batch(0)
    assert dec.batch(1).num_rows == 40  # the others still read
    with pytest.raises(FormatError, match="shard 7: record batch 0"):
        Decompressor(bytes(data), "shard 7").write_plain(pa.BufferOutputStream())


def test_a_full_sink_raises_its_own_oserror_not_a_format_error(tmp_path):
    data = _stdlib_file(tmp_path)
    small = pa.FixedSizeBufferWriter(pa.py_buffer(bytearray(len(data))))
    with pytest.raises(OSError):
        Decompressor(data, "shard 0").write_plain(small)


def _file_and_ranges(codec: str = "zstd") -> tuple[bytes, list[tuple[int, int]]]:
    """An Arrow IPC file of stdlib sources and each record batch's byte range, as the writer records
    them in the sample index (the first one from the file's start, with the schema message)."""
    root = sysconfig.get_paths()["stdlib"]
    paths = sorted(os.path.join(d, n) for d, _, files in os.walk(root) for n in files if n.endswith(".py"))[:120]
    schema = pa.schema([("__key__", pa.string()), ("text", pa.binary())])
    sink = pa.BufferOutputStream()
    ends = []
    with pa.ipc.new_file(sink, schema, options=pa.ipc.IpcWriteOptions(compression=codec)) as writer:
        for i in range(0, len(paths), 40):
            part = paths[i : i + 40]
            writer.write_batch(
                pa.record_batch([pa.array(part), pa.array([open(p, "rb").read() for p in part])], schema)
            )
            ends.append(sink.tell())
    return sink.getvalue().to_pybytes(), list(zip([0, *ends[:-1]], ends))


def test_a_record_batch_fetched_by_its_range_decodes_as_the_file_reads_it():
    data, ranges = _file_and_ranges()
    dec = Decompressor(data, "shard 7")
    for k, (a, b) in enumerate(ranges):
        assert range_batch(data[a:b], dec.schema, "shard 7").equals(dec.batch(k))


def test_a_range_that_is_no_record_batch_names_the_shard():
    data, ranges = _file_and_ranges()
    schema = Decompressor(data, "s").schema
    a, b = ranges[1]
    with pytest.raises(FormatError, match="shards/00007.arrow: a record batch cannot be decompressed"):
        range_batch(data[a : b - 64], schema, "shards/00007.arrow")  # cut short: its body is missing
    with pytest.raises(FormatError, match="shards/00007.arrow: a record batch's byte range holds no record batch"):
        range_batch(data[:8], schema, "shards/00007.arrow")  # the magic alone
