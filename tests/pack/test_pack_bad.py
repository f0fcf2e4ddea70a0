"""Bad input: a clear error naming file and position, or with skip_bad a count and a list."""

from __future__ import annotations

import gzip
import os
import signal
import subprocess
import sys
import time

import pytest

import shardtool
from helpers.data_gen import dir_digest, image_samples, read_all, token_records, write_jsonl, write_tar, write_tree
from shardtool.format.errors import BadSampleError, ShardtoolError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _jsonl(tmp_path, lines):
    return write_jsonl(str(tmp_path / "in.jsonl"), [], raw_lines=lines)


GOOD = '{"tokens": [1, 2, 3], "n": 3}'
CASES = {
    "malformed JSON": ([GOOD, '{"tokens": [1, 2', GOOD], {}, r"in\.jsonl \(line 2\): malformed JSON"),
    "missing length field": ([GOOD, '{"n": 4}', GOOD], {"length": "tokens"}, r"line 2\): missing length field"),
    "negative length": ([GOOD, '{"tokens": [1], "n": -4}', GOOD], {"length": "n"}, r"line 2\): bad length.*negative"),
    "non-integer length": ([GOOD, '{"tokens": [1], "n": "x"}', GOOD], {"length": "n"}, r"line 2\): field 'n'"),
    "field sets differ": ([GOOD, '{"tokens": [1], "n": 1, "extra": 2}', GOOD], {}, r"line 2\): sample .* has fields"),
    "duplicate keys": (
        ['{"id": "a", "n": 1}', '{"id": "b", "n": 1}', '{"id": "a", "n": 2}'],
        {"key": "id"},
        r"line 3\): duplicate key 'a'",
    ),
    "key with slash": (['{"id": "a/b", "n": 1}', '{"id": "c", "n": 1}'], {"key": "id"}, r"line 1\): key .* '/'"),
    "key with dotdot": (['{"id": "..x", "n": 1}', '{"id": "c", "n": 1}'], {"key": "id"}, r"line 1\): key .*"),
    "key with NUL": (['{"id": "a\\u0000", "n": 1}', '{"id": "c", "n": 1}'], {"key": "id"}, r"line 1\): key .*NUL"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_jsonl_line(tmp_path, case):
    lines, kw, pattern = CASES[case]
    src = _jsonl(tmp_path, lines)
    with pytest.raises(BadSampleError, match=pattern):
        shardtool.pack(src, str(tmp_path / "o"), **kw)
    assert not os.path.exists(tmp_path / "o" / "index.json")
    r = shardtool.pack(src, str(tmp_path / "o2"), skip_bad=True, **kw)
    assert len(r.skipped) == 1 and r.samples == len(lines) - 1
    assert os.path.exists(tmp_path / "o2" / "index.json")


@pytest.mark.timeout(60)
def test_missing_unreadable_empty_and_oversized(tmp_path):
    with pytest.raises(BadSampleError, match="nope.jsonl: source does not exist"):
        shardtool.pack(str(tmp_path / "nope.jsonl"), str(tmp_path / "o"))
    good = write_jsonl(str(tmp_path / "good.jsonl"), token_records(5))
    r = shardtool.pack([str(tmp_path / "nope.jsonl"), good], str(tmp_path / "o"), skip_bad=True)
    assert r.samples == 5 and "nope.jsonl" in r.skipped[0]
    empty = _jsonl(tmp_path, [""])
    with pytest.raises(ShardtoolError, match=r"no samples .*\(no rows or lines in .*in\.jsonl\)"):
        shardtool.pack(empty, str(tmp_path / "o3"))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"tokens": pa.array([], pa.list_(pa.int32()))}), str(tmp_path / "zero.parquet"))
    with pytest.raises(ShardtoolError, match=r"no rows or lines in .*zero\.parquet\)"):
        shardtool.pack(str(tmp_path / "zero.parquet"), str(tmp_path / "o5"))
    control = _jsonl(tmp_path, ['{"text": "a", "nl\\nx": "v"}'])  # a newline in a tar member's name
    with pytest.raises(BadSampleError, match=r"field name 'nl\\nx' cannot be part of a tar member name"):
        shardtool.pack(control, str(tmp_path / "o6"))
    big = write_jsonl(str(tmp_path / "big.jsonl"), [{"x": "a" * 5000}])
    with pytest.raises(BadSampleError, match=r"big.jsonl \(line 1\): sample '000000000' is .* larger than the shard"):
        shardtool.pack(big, str(tmp_path / "o4"), shard_size=4096)


@pytest.mark.timeout(60)
def test_non_utf8_key_from_tar_and_tree_key_rules(tmp_path):
    write_tree(str(tmp_path / "t"), image_samples(3))
    open(tmp_path / "t" / "noext", "wb").close()
    with pytest.raises(BadSampleError, match="noext: file has no '<key>.<field>' name"):
        shardtool.pack(str(tmp_path / "t"), str(tmp_path / "o"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "member,pattern",
    [
        ("/abs/0001.jpg", "absolute member path"),
        ("../0001.jpg", r"contains '\.\.'"),
    ],
)
def test_tar_member_paths_refused(tmp_path, member, pattern):
    src = write_tar(str(tmp_path / "in.tar"), [("0000.jpg", b"ok"), (member, b"evil"), ("0002.jpg", b"ok")])
    with pytest.raises(BadSampleError, match=pattern):
        shardtool.pack(src, str(tmp_path / "o"))
    r = shardtool.pack(src, str(tmp_path / "o2"), skip_bad=True)
    assert r.samples == 2 and len(r.skipped) == 1
    assert not os.path.exists(tmp_path / "abs") and not os.path.exists(tmp_path.parent / "0001.jpg")


@pytest.mark.timeout(60)
def test_tar_links_never_followed(tmp_path):
    src = write_tar(str(tmp_path / "in.tar"), [("0000.jpg", b"ok")], links=[("0001.jpg", "/etc/passwd")])
    with pytest.raises(BadSampleError, match=r"member #2 '0001.jpg'\): link member"):
        shardtool.pack(src, str(tmp_path / "o"))


@pytest.mark.timeout(60)
def test_gzip_bomb_is_refused_with_bounded_memory(tmp_path):
    import resource

    path = tmp_path / "bomb.jsonl.gz"
    with gzip.open(path, "wb", compresslevel=9) as f:  # 512 MiB of zeros, no newline, ~0.5 MB on disk
        chunk = b"0" * (1 << 20)
        for _ in range(512):
            f.write(chunk)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(BadSampleError, match=r"bomb.jsonl.gz \(line 1\): line is longer than"):
        shardtool.pack(str(path), str(tmp_path / "o"), max_sample_bytes="16MiB")
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 200


def _run_pack(src, out, *extra):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.Popen(
        [sys.executable, "-m", "shardtool", "pack", src, "-o", out, "-q", "--samples-per-shard", "2000", *extra],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


@pytest.mark.timeout(180)
def test_sigkill_mid_shard_then_rerun_is_identical(tmp_path):
    src = write_jsonl(str(tmp_path / "in.jsonl"), token_records(20000, max_len=200))
    ref = str(tmp_path / "ref")
    p = _run_pack(src, ref)
    assert p.wait(timeout=120) == 0, p.stderr.read()
    out = str(tmp_path / "out")
    p = _run_pack(src, out)
    shard_dir = os.path.join(out, "shards")
    deadline = time.time() + 60
    # Kill once a temp shard exists (mid-shard), ideally after a finished shard too.
    while time.time() < deadline:
        names = os.listdir(shard_dir) if os.path.isdir(shard_dir) else []
        if any(n.startswith(".tmp-") for n in names) and any(n.endswith(".tar") for n in names):
            break
        time.sleep(0.005)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    assert not os.path.exists(os.path.join(out, "index.json"))
    p = _run_pack(src, out)
    assert p.wait(timeout=120) == 0, p.stderr.read()
    assert dir_digest(out) == dir_digest(ref)


@pytest.mark.timeout(180)
def test_sigkill_mid_overwrite_keeps_the_old_dataset_published(tmp_path):
    """--overwrite unpublished the old dataset first: a kill (or a bad line) lost it."""
    old = write_jsonl(str(tmp_path / "old.jsonl"), token_records(300, seed=1))
    src = write_jsonl(str(tmp_path / "in.jsonl"), token_records(20000, max_len=200))
    out = str(tmp_path / "out")
    assert _run_pack(old, out).wait(timeout=120) == 0
    kept = dir_digest(out)
    p = _run_pack(src, out, "--overwrite")
    staging = os.path.join(out, ".shardtool-overwrite", "shards")
    deadline = time.time() + 60
    while time.time() < deadline and not any(n.endswith(".tar") for n in _names(staging)):
        time.sleep(0.005)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    left = dir_digest(out)
    assert {k: v for k, v in left.items() if not k.startswith(".shardtool-overwrite")} == kept
    assert len(read_all(out)) == 300  # still the old dataset, whole
    assert _run_pack(src, out, "--overwrite").wait(timeout=120) == 0
    assert len(read_all(out)) == 20000 and not os.path.exists(os.path.join(out, ".shardtool-overwrite"))


def _names(directory: str) -> list[str]:
    return os.listdir(directory) if os.path.isdir(directory) else []


def _stdlib_parquet_with_a_bad_row_group(tmp_path) -> tuple[str, int]:
    """Stdlib files as Parquet in row groups of 50, the first group's text pages zeroed in the
    middle (a disk error, a torn copy): (path, rows)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from helpers.realtext import write_stdlib_jsonl

    texts = write_stdlib_jsonl(str(tmp_path / "s.jsonl"), limit=168)
    path = str(tmp_path / "corrupt.parquet")
    pq.write_table(pa.table({"text": texts}), path, row_group_size=50)
    chunk = pq.ParquetFile(path).metadata.row_group(0).column(0)
    first = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
    middle = first + chunk.total_compressed_size // 2
    with open(path, "r+b") as f:
        f.seek(middle)
        f.write(bytes(100))
    return path, len(texts)


def test_an_unreadable_row_group_counts_its_rows_as_skipped(tmp_path):
    """It counted as one skip, so --max-skip-fraction 0.05 let 50 of 168 rows (30%) go silently."""
    path, rows = _stdlib_parquet_with_a_bad_row_group(tmp_path)
    with pytest.raises(ShardtoolError, match=rf"50 of {rows} samples were skipped .*row group 0.*its 50 rows"):
        shardtool.pack([path], str(tmp_path / "strict"), max_skip_fraction=0.05)
    assert not os.path.exists(tmp_path / "strict" / "index.json")
    got = shardtool.pack([path], str(tmp_path / "ok"), skip_bad=True, max_skip_fraction=0.5)
    assert got.samples == rows - 50 and "skipped 50;" in got.summary()


def test_a_truncated_compressed_source_fails_a_skip_limit_it_cannot_check(tmp_path):
    """A .jsonl.gz cut short: how many samples it held is unknown, so a stated limit refuses it,
    and without a limit the pack says so instead of counting it as one sample."""
    from helpers.realtext import write_stdlib_jsonl

    write_stdlib_jsonl(str(tmp_path / "good.jsonl"), limit=40)
    whole = gzip.compress(open(tmp_path / "good.jsonl", "rb").read())
    (tmp_path / "cut.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    srcs = [str(tmp_path / "cut.jsonl.gz"), str(tmp_path / "good.jsonl")]
    with pytest.raises(ShardtoolError, match=r"1 source\(s\) could not be read to their end .*cannot be checked"):
        shardtool.pack(srcs, str(tmp_path / "strict"), max_skip_fraction=0.9)
    got = shardtool.pack(srcs, str(tmp_path / "ok"), skip_bad=True)
    assert got.samples == 40 and any("size is unknown" in w or "is unknown" in w for w in got.warnings)
