"""`shardtool index`: WebDataset tars indexed in place, read, verified, warmed and trained on
without being copied or changed."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile

import numpy as np
import pytest

from helpers.runcli import shardtool_cli
from helpers.s3server import free_port
from helpers.webtars import add, text_samples, write_collection, write_stdlib_tars, write_tar
from shardtool.cache import warm
from shardtool.format import open_dataset
from shardtool.format.errors import BadSampleError, FormatError
from shardtool.loader import ShardedLoader
from shardtool.pack import pack
from shardtool.pack.inplace import index_tars
from shardtool.pack.verify import verify

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)


def digests(paths) -> dict[str, str]:
    return {p: hashlib.sha256(open(p, "rb").read()).hexdigest() for p in paths}


def samples(ds) -> list[dict]:
    return [dict(s) for s in ds]


@pytest.fixture(scope="module")
def tars(tmp_path_factory):
    return write_collection(str(tmp_path_factory.mktemp("c") / "tars"), shards=4, per_shard=25)


def test_index_reads_as_pack_of_the_same_tars_and_leaves_them_untouched(tars, tmp_path):
    before = digests(tars)
    r = index_tars(tars, str(tmp_path / "ds"), length="txt")
    assert (r.tars, r.samples) == (4, 100)
    packed = pack(tars, str(tmp_path / "packed"), length="txt")
    ds, ref = open_dataset(str(tmp_path / "ds")), open_dataset(packed.out)
    assert samples(ds) == samples(ref)
    assert np.array_equal(ds.lengths, ref.lengths)
    assert ds.manifest.fields == ref.manifest.fields and ds.manifest.length == ref.manifest.length
    rel = os.path.relpath(os.path.dirname(tars[0]), str(tmp_path / "ds"))
    assert [s.source for s in ds.manifest.shards] == [f"{rel}/{i:06d}.tar" for i in range(4)]
    assert samples(ds)[30]["__key__"] == "part1__s0005"  # dir/stem.ext is keyed as pack keys it
    assert verify(str(tmp_path / "ds"))["ok"]
    assert digests(tars) == before
    # only metadata was written
    assert not any(f.endswith(".tar") for _, _, fs in os.walk(tmp_path / "ds") for f in fs)


def test_lengths_from_a_json_key_with_workers_on_real_text(tmp_path):
    paths = write_stdlib_tars(str(tmp_path / "src"), shards=3, per_shard=40)
    r = index_tars(str(tmp_path / "src"), str(tmp_path / "ds"), length="json:num_tokens", workers=2)
    ds = open_dataset(r.out)
    expected = [len(s["py"]) for s in ds]
    assert ds.lengths.tolist() == expected and r.samples == 120
    assert ds.manifest.length["unit"] == "value"  # a count batches pad: bucketing is on by default
    one = index_tars(paths, str(tmp_path / "one"), length="json:num_tokens", workers=1)
    assert (
        open(os.path.join(r.out, "index.json"), "rb").read() == open(os.path.join(one.out, "index.json"), "rb").read()
    )


def test_length_fn_and_payload_bytes(tars, tmp_path):
    ds = open_dataset(index_tars(tars[:1], str(tmp_path / "a")).out)
    raw = [ds.read(0, i, decode=False) for i in range(len(ds))]
    assert ds.lengths.tolist() == [len(x["txt"]) + len(x["json"]) for x in raw]
    ds = open_dataset(index_tars(tars[:1], str(tmp_path / "b"), length_fn="helpers.tests_length_fn:txt_words").out)
    assert ds.lengths.tolist() == [len(x["txt"].split()) for x in raw]
    assert ds.manifest.length == {**ds.manifest.length, "unit": "fn", "fn": "helpers.tests_length_fn:txt_words"}


def _bad_tar(path: str, kind: str) -> str:
    good = text_samples(9, 3)
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tf:
        for key, fields in good[:2]:
            for ext, data in fields.items():
                add(tf, f"{key}.{ext}", data)
        if kind == "symlink":
            info = tarfile.TarInfo("evil.txt")
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tf.addfile(info)
        elif kind == "hardlink":
            info = tarfile.TarInfo("evil.txt")
            info.type, info.linkname = tarfile.LNKTYPE, good[0][0] + ".txt"
            tf.addfile(info)
        elif kind == "dotdot":
            add(tf, "../escape.txt", b"x")
        elif kind == "absolute":
            add(tf, "/etc/cron.d/x.txt", b"x")
        elif kind == "oversized":
            add(tf, "big.txt", b"y" * 5000)
            add(tf, "big.json", b"{}")
        elif kind == "fields":
            add(tf, "other.txt", b"no json")
        elif kind == "fifo":
            info = tarfile.TarInfo("pipe.txt")
            info.type = tarfile.FIFOTYPE
            tf.addfile(info)
    if kind == "truncated":
        with open(path, "r+b") as f:  # inside the payload of the second sample's first member
            f.truncate(2 * 1024 + 512 + 10)
    if kind == "garbage":
        with open(path, "wb") as f:
            f.write(os.urandom(4096))
    return path


BAD = {
    "symlink": "link member",
    "hardlink": "link member",
    "dotdot": "'..'",
    "absolute": "absolute member path",
    "oversized": "over the 4096-byte limit",
    "fields": "has fields",
    "fifo": "special file",
    "truncated": "truncated",
    "garbage": "corrupt tar header",
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_a_bad_tar_is_named_nothing_is_published_and_skip_bad_lists_it(tars, tmp_path, kind):
    bad = _bad_tar(str(tmp_path / f"bad-{kind}.tar"), kind)
    out = str(tmp_path / "ds")
    with pytest.raises(BadSampleError) as e:
        index_tars([tars[0], bad, tars[1]], out, max_member_bytes=4096)
    assert bad in str(e.value) and BAD[kind] in str(e.value)
    if kind not in ("truncated", "garbage", "fields"):
        assert "member" in str(e.value)
    assert not os.path.exists(os.path.join(out, "index.json"))
    assert (
        not [f for f in os.listdir(os.path.join(out, "shards"))] if os.path.isdir(os.path.join(out, "shards")) else True
    )
    r = index_tars([tars[0], bad, tars[1]], out, max_member_bytes=4096, skip_bad=True)
    assert r.tars == 2 and len(r.skipped) == 1 and bad in r.skipped[0]
    assert [s.source.rsplit("/", 1)[1] for s in open_dataset(out).manifest.shards] == ["000000.tar", "000001.tar"]


def test_fields_that_differ_between_tars_and_duplicate_keys_name_the_tar(tars, tmp_path):
    other = write_tar(str(tmp_path / "other.tar"), [("zz", {"txt": b"a"})])
    with pytest.raises(BadSampleError, match="other.tar.*fields"):
        index_tars([tars[0], other], str(tmp_path / "a"))
    shutil.copy(tars[0], tmp_path / "copy.tar")
    with pytest.raises(BadSampleError, match="copy.tar.*duplicate key"):
        index_tars([tars[0], str(tmp_path / "copy.tar")], str(tmp_path / "b"))
    assert not os.path.exists(tmp_path / "b" / "index.json")


def test_a_tar_changed_after_indexing_is_caught_at_read_warm_and_verify(tars, tmp_path):
    src = str(tmp_path / "tars")
    shutil.copytree(os.path.dirname(tars[0]), src)
    out = index_tars(src, str(tmp_path / "ds")).out
    ds = open_dataset(out)
    idx = ds.shard_index(2)
    target = os.path.join(src, "000002.tar")
    with open(target, "r+b") as f:  # one payload byte of sample 3, same size and name
        f.seek(int(idx.offsets[3]) + int(idx.field_offsets[3, 1]))
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x20]))
    with pytest.raises(FormatError, match="000002.tar sample #3.*checksum"):
        open_dataset(out).read(2, 3)
    assert open_dataset(out).read(2, 2)["__key__"]  # the other samples still read
    report = warm(out, str(tmp_path / "cache"), all_shards=True)
    assert report.status != "ok" and report.shards_failed == 1
    assert "shards/000002.tar" in json.dumps(report.failures) and "hash" in json.dumps(report.failures)
    assert report.shards_copied == 3
    v = verify(out)
    assert not v["ok"] and [b["shard"] for b in v["bad"]] == ["shards/000002.tar"]


def test_cli_job_array_and_merge_give_the_manifest_of_one_run(tars, tmp_path):
    one = str(tmp_path / "one")
    res = shardtool_cli("index", *tars, "-o", one, "--length-field", "json:num_tokens", "--workers", "2")
    assert res.returncode == 0, res.stderr
    assert "indexed 100 samples in 4 tars" in res.stdout
    arr = str(tmp_path / "arr")
    for t in range(2):
        res = shardtool_cli(
            "index",
            *tars,
            "-o",
            arr,
            "--length-field",
            "json:num_tokens",
            "--num-tasks",
            "2",
            "--task-index",
            str(t),
            "--json",
        )
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["fragment"]
    res = shardtool_cli("merge", arr)
    assert res.returncode == 0, res.stderr
    assert open(os.path.join(arr, "index.json"), "rb").read() == open(os.path.join(one, "index.json"), "rb").read()
    bad = shardtool_cli("index", tars[0], str(tmp_path / "nope.tar"), "-o", str(tmp_path / "x"))
    assert bad.returncode == 1 and "nope.tar" in bad.stderr and "does not exist" in bad.stderr


def test_a_tar_behind_a_url_is_read_through_fsspec(tars, tmp_path):
    import fsspec

    mem = fsspec.filesystem("memory")
    mem.pipe("/adopt/000001.tar", open(tars[1], "rb").read())
    r = index_tars([tars[0], "memory://adopt/000001.tar"], str(tmp_path / "url"))
    ds = open_dataset(r.out)
    assert ds.manifest.shards[1].source == "memory://adopt/000001.tar"
    assert samples(ds) == samples(open_dataset(index_tars(tars[:2], str(tmp_path / "plain")).out))
    cache = warm(r.out, str(tmp_path / "cache"), all_shards=True)
    assert cache.status == "ok" and cache.shards_copied == 2
    assert samples(open_dataset(cache.version_dir)) == samples(ds)


# ------------------------------------------------------------------ training from warmed caches
WORKER = os.path.join(TESTS, "helpers", "cold_cache_worker.py")


@pytest.mark.timeout(240)
def test_torchrun_trains_from_warmed_node_cache_with_the_tars_untouched(tmp_path):
    tars = write_collection(str(tmp_path / "tars"), shards=6, per_shard=40)
    before = digests(tars)
    out = index_tars(tars, str(tmp_path / "ds"), length="json:num_tokens", workers=2).out
    expected = []
    for r in range(2):
        loader = ShardedLoader(out, max_tokens=2048, seed=0, rank=r, world_size=2, ranks_per_node=2, num_workers=0)
        expected.append([list(b["__key__"]) for b in loader][:8])
    cache_dir = str(tmp_path / "cache")
    report = warm(out, cache_dir, all_shards=True)
    assert report.status == "ok" and report.shards_copied == 6
    hidden = str(tmp_path / "hidden")
    os.rename(str(tmp_path / "tars"), hidden)  # the run must read the warmed cache, never the tars
    try:
        env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=1",
            "--nproc_per_node=2",
            "--master_addr=127.0.0.1",
            f"--master_port={free_port()}",
            WORKER,
            "--data",
            out,
            "--cache-dir",
            cache_dir,
            "--out",
            str(tmp_path / "run"),
            "--max-steps",
            "8",
            "--num-workers",
            "1",
            "--collective-timeout",
            "30",
        ]
        os.makedirs(tmp_path / "run")
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=200, start_new_session=True)
        assert res.returncode == 0, res.stderr[-3000:]
    finally:
        os.rename(hidden, str(tmp_path / "tars"))
    got = [json.load(open(tmp_path / "run" / f"rank{r}.json")) for r in range(2)]
    assert got == expected
    assert digests(tars) == before


# ------------------------------------------------------------------ the header parser, against tarfile and pack
from hypothesis import HealthCheck, given, settings  # noqa: E402

from helpers.strategies import tar_samples  # noqa: E402


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(drawn=tar_samples())
def test_any_tar_reads_back_as_packing_it_reads(tmp_path_factory, drawn):
    fmt, rows = drawn
    tmp = tmp_path_factory.mktemp("h")
    tar = write_tar(str(tmp / "x.tar"), rows, fmt=fmt)
    ds = open_dataset(index_tars([tar], str(tmp / "ds")).out)
    ref = open_dataset(pack([tar], str(tmp / "p")).out)
    assert [ds.read(0, i, decode=False) for i in range(len(ds))] == [
        ref.read(0, i, decode=False) for i in range(len(ref))
    ]
    with tarfile.open(tar) as tf:  # every payload offset is tarfile's, too
        offsets = {m.name: m.offset_data for m in tf.getmembers()}
    idx = ds.shard_index(0)
    for i, (key, fields) in enumerate(rows):
        for j, ext in enumerate(sorted(fields)):
            assert int(idx.offsets[i]) + int(idx.field_offsets[i, j]) == offsets[f"{key}.{ext}"]
    assert verify(str(tmp / "ds"))["ok"]


def test_overwrite_with_fewer_tars_leaves_no_stale_index(tars, tmp_path):
    out = str(tmp_path / "ds")
    index_tars(tars, out)
    with pytest.raises(Exception, match="already holds a dataset"):
        index_tars(tars[:2], out)
    index_tars(tars[:2], out, overwrite=True)
    assert sorted(os.listdir(os.path.join(out, "shards"))) == ["000000.idx.arrow", "000001.idx.arrow"]
    assert verify(out)["ok"] and len(open_dataset(out)) == 50
