"""Fault suite, pack: kills, bad and hostile input, pickle payloads, a full disk.

Real processes and files; faults come from the storage edge (a killed process, a tiny tmpfs,
hostile bytes in the sources), never from mocking our own code. Already covered elsewhere and
not repeated here: malformed JSONL lines and bad keys from a key field (tests/pack/test_pack_bad.py
``test_bad_jsonl_line``), '../' and absolute tar members, a symlink member and a gzip bomb in
JSONL (same file), a timed SIGKILL mid-shard (``test_sigkill_mid_shard_then_rerun_is_identical``).
"""

from __future__ import annotations

import functools
import gzip
import io
import os
import pickle
import signal
import subprocess
import sys
import tarfile

import pytest

import shardtool
from helpers.data_gen import dir_digest, token_records, write_jsonl, write_tar
from helpers.fsutil import temps, tmpfs
from helpers.runcli import repo_env, shardtool_cli
from shardtool.format import PickleRefusedError, ShardIndex
from shardtool.format.errors import BadSampleError, ShardtoolError
from shardtool.pack.verify import verify

cli = functools.partial(shardtool_cli, timeout=120)


def files_under(root) -> set[str]:
    return {os.path.relpath(os.path.join(d, n), root) for d, _, files in os.walk(root) for n in files}


# ------------------------------------------------------------------------------------ SIGKILL
# Runs `python -m shardtool ...` with os.replace wrapped so the whole process group is SIGKILLed
# just before the n-th rename onto a path ending with the given suffix: the storage-edge moment
# a kill is hardest to survive (temp file complete, not yet published).
KILLER = r"""
import os, runpy, signal, sys
suffix, nth = sys.argv[1], int(sys.argv[2])
del sys.argv[1:3]
real, seen = os.replace, [0]
def replace(src, dst, *a, **k):
    if str(dst).endswith(suffix):
        seen[0] += 1
        if seen[0] == nth:
            os.killpg(os.getpgrp(), signal.SIGKILL)
    return real(src, dst, *a, **k)
os.replace = replace
sys.argv[0] = "shardtool"
runpy.run_module("shardtool", run_name="__main__")
"""


def _two_sources(tmp_path) -> list[str]:
    """Two input files, so two workers really get one unit each."""
    recs = token_records(2000, max_len=50)
    return [write_jsonl(str(tmp_path / "a.jsonl"), recs[:1000]), write_jsonl(str(tmp_path / "b.jsonl"), recs[1000:])]


def _pack_args(src, out, workers):
    return [
        "pack",
        *src,
        "-o",
        out,
        "-q",
        "--samples-per-shard",
        "300",
        "--length",
        "tokens",
        "--workers",
        str(workers),
    ]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize(
    "point",
    [("000001.tar", 1), (".idx.arrow", 2), ("lengths.npy", 1), ("index.json", 1)],
    ids=["mid-shards", "shard-index", "lengths", "manifest"],
)
def test_sigkill_at_publish_points_then_rerun_is_identical(tmp_path, workers, point):
    src = _two_sources(tmp_path)
    ref = str(tmp_path / "ref")
    p = cli(*_pack_args(src, ref, workers))
    assert p.returncode == 0, p.stderr
    killer = tmp_path / "killer.py"
    killer.write_text(KILLER)
    out = str(tmp_path / "out")
    p = subprocess.run(
        [sys.executable, str(killer), point[0], str(point[1]), *_pack_args(src, out, workers)],
        env=repo_env(),
        capture_output=True,
        timeout=120,
        start_new_session=True,
    )
    assert p.returncode == -signal.SIGKILL, p.stderr
    # No manifest may exist, so no reader can be pointed at the partial output.
    assert not os.path.exists(os.path.join(out, "index.json"))
    p = cli(*_pack_args(src, out, workers))
    assert p.returncode == 0, p.stderr
    assert temps(out) == []
    assert dir_digest(out) == dir_digest(ref)
    assert verify(out)["ok"]


@pytest.mark.timeout(120)
def test_killed_worker_fails_the_pack_instead_of_hanging(tmp_path):
    """A worker SIGKILLed (say by the OOM killer) must end the pack with an error, not a hang."""
    src = _two_sources(tmp_path)
    killer = tmp_path / "killer.py"
    # Kill only the process doing the 2nd shard rename of worker 1 (a forked pool worker).
    killer.write_text(KILLER.replace("os.killpg(os.getpgrp(), signal.SIGKILL)", "os.kill(os.getpid(), signal.SIGKILL)"))
    out = str(tmp_path / "out")
    p = subprocess.run(
        [sys.executable, str(killer), "w01-000001.tar", "1", *_pack_args(src, out, 2)],
        env=repo_env(),
        capture_output=True,
        text=True,
        timeout=90,
        start_new_session=True,
    )
    assert p.returncode not in (0, -signal.SIGKILL), p.stderr
    assert "worker" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not os.path.exists(os.path.join(out, "index.json"))
    assert temps(out) == []


# ------------------------------------------------------------------------------------ bad input
@pytest.mark.timeout(120)
def test_undecodable_inputs_name_path_and_position_and_skip_bad_lists_them(tmp_path):
    good = '{"tokens": [1, 2, 3]}'
    bad_utf8 = tmp_path / "utf8.jsonl"
    bad_utf8.write_bytes(b"\n".join([good.encode(), b'{"tokens": [1], "x": "\xff\xfe"}', good.encode()]) + b"\n")
    with pytest.raises(BadSampleError, match=r"utf8\.jsonl \(line 2\)"):
        shardtool.pack(str(bad_utf8), str(tmp_path / "o1"))
    # A compressed stream cut in the middle: the error names the file and the last good line.
    gz = tmp_path / "cut.jsonl.gz"
    data = gzip.compress(("\n".join([good] * 5000) + "\n").encode(), mtime=0)
    gz.write_bytes(data[: len(data) // 2])
    with pytest.raises(BadSampleError, match=r"cut\.jsonl\.gz.*after line \d+"):
        shardtool.pack(str(gz), str(tmp_path / "o2"))
    pq = tmp_path / "broken.parquet"
    pq.write_bytes(b"PAR1" + os.urandom(200) + b"PAR1")
    with pytest.raises(BadSampleError, match=r"broken\.parquet"):
        shardtool.pack(str(pq), str(tmp_path / "o3"))
    ok = write_jsonl(str(tmp_path / "ok.jsonl"), [{"tokens": [i, 1]} for i in range(10)])
    p = cli("pack", str(bad_utf8), str(pq), ok, "-o", str(tmp_path / "o4"), "-q", "--skip-bad", "--json")
    assert p.returncode == 0, p.stderr
    import json

    res = json.loads(p.stdout)
    assert len(res["skipped"]) == 2 and res["samples"] == 12
    assert any("utf8.jsonl (line 2)" in s for s in res["skipped"]) and any(
        "broken.parquet" in s for s in res["skipped"]
    )
    p = cli("pack", str(bad_utf8), str(pq), ok, "-o", str(tmp_path / "o5"), "-q", "--skip-bad")
    assert p.returncode == 0 and "skipped 2" in p.stdout
    assert p.stderr.count("skipped: ") == 2 and "utf8.jsonl (line 2)" in p.stderr


@pytest.mark.timeout(60)
def test_tar_sample_larger_than_shard_size(tmp_path):
    src = write_tar(str(tmp_path / "in.tar"), [("a.bin", b"x" * 100), ("b.bin", b"y" * 20000), ("c.bin", b"z")])
    with pytest.raises(BadSampleError, match=r"in\.tar \(member 'b\.bin'\): sample 'b' is \d+ bytes, larger than"):
        shardtool.pack(src, str(tmp_path / "o"), shard_size=8192)
    assert not os.path.exists(tmp_path / "o" / "index.json") and temps(tmp_path / "o") == []
    r = shardtool.pack(src, str(tmp_path / "o2"), shard_size=8192, skip_bad=True)
    assert r.samples == 2 and len(r.skipped) == 1 and "'b'" in r.skipped[0]


BAD_KEYS = {"backslash": "a\\b", "newline": "a\nb", "long": "k" * 300, "absolute": "/etc/x", "dotdot": "../x"}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(BAD_KEYS))
def test_bad_keys_rejected_at_pack_time(tmp_path, name):
    import json

    key = BAD_KEYS[name]
    src = write_jsonl(
        str(tmp_path / "in.jsonl"), [], raw_lines=[json.dumps({"id": "ok", "n": 1}), json.dumps({"id": key, "n": 2})]
    )
    with pytest.raises(BadSampleError, match=r"in\.jsonl \(line 2\): key"):
        shardtool.pack(src, str(tmp_path / "o"), key="id")
    assert not os.path.exists(tmp_path / "o" / "index.json")
    # The same key as a tar member name (where a tar can hold it).
    if name in ("backslash", "newline", "long"):
        tsrc = write_tar(str(tmp_path / "in.tar"), [("ok.bin", b"1"), (f"{key}.bin", b"2")])
        with pytest.raises(BadSampleError, match=r"in\.tar .*key"):
            shardtool.pack(tsrc, str(tmp_path / "o2"))


@pytest.mark.timeout(60)
def test_duplicate_keys_in_a_tar_source_are_rejected(tmp_path):
    src = write_tar(str(tmp_path / "in.tar"), [("a.bin", b"1"), ("b.bin", b"2"), ("a.bin", b"3")])
    with pytest.raises(BadSampleError, match=r"in\.tar \(member 'a\.bin'\): duplicate key 'a'"):
        shardtool.pack(src, str(tmp_path / "o"))
    r = shardtool.pack(src, str(tmp_path / "o2"), skip_bad=True)
    assert r.samples == 2 and len(r.skipped) == 1


# ------------------------------------------------------------------------------------ hostile tars
def _special_tar(path, kind: str) -> str:
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tf:
        good = tarfile.TarInfo("0000.bin")
        good.size = 2
        tf.addfile(good, io.BytesIO(b"ok"))
        info = tarfile.TarInfo("0001.bin")
        if kind == "hardlink":
            info.type, info.linkname = tarfile.LNKTYPE, "0000.bin"
        elif kind == "hardlink-outside":
            info.type, info.linkname = tarfile.LNKTYPE, "../../outside-target"
        elif kind == "symlink-outside":
            info.type, info.linkname = tarfile.SYMTYPE, "../../outside-target"
        elif kind == "chardev":
            info.type, info.devmajor, info.devminor = tarfile.CHRTYPE, 1, 3
        elif kind == "blockdev":
            info.type, info.devmajor, info.devminor = tarfile.BLKTYPE, 8, 0
        elif kind == "fifo":
            info.type = tarfile.FIFOTYPE
        tf.addfile(info)
        after = tarfile.TarInfo("0002.bin")
        after.size = 2
        tf.addfile(after, io.BytesIO(b"ok"))
    return path


# Runs the CLI and reports its own VmHWM at exit. rusage's ru_maxrss would be wrong here: Linux
# keeps it across exec, so a child forked from a big pytest process inherits the parent's RSS.
_MEASURED = """
import atexit, runpy, sys
def _peak():
    with open("/proc/self/status") as f:
        hwm = next(line for line in f if line.startswith("VmHWM:"))
    sys.stderr.write("\\nPEAK_KIB " + hwm.split()[1] + "\\n")
atexit.register(_peak)
sys.argv = ["shardtool", *sys.argv[1:]]
runpy.run_module("shardtool", run_name="__main__")
"""


def _run_measured(args, cwd) -> tuple[int, str, int]:
    """Run the CLI; returns (exit code, stderr, peak RSS of that process alone in MiB)."""
    p = subprocess.run(
        [sys.executable, "-c", _MEASURED, *args],
        env=repo_env(),
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        timeout=170,
        start_new_session=True,
    )
    err = p.stderr.decode()
    peak = [int(line.split()[1]) for line in err.splitlines() if line.startswith("PEAK_KIB ")]
    if not peak:
        raise AssertionError(f"no peak RSS reported (exit {p.returncode}):\n{err}")
    err = "\n".join(line for line in err.splitlines() if not line.startswith("PEAK_KIB "))
    return p.returncode, err, peak[-1] // 1024


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["hardlink", "hardlink-outside", "symlink-outside", "chardev", "blockdev", "fifo"])
def test_special_tar_members_refused_nothing_created(tmp_path, kind):
    work = tmp_path / "work"
    work.mkdir()
    src = _special_tar(str(work / "in.tar"), kind)
    before = files_under(tmp_path)
    out = str(work / "o")
    rc, err, _ = _run_measured(["pack", src, "-o", out, "-q"], cwd=str(work))
    assert rc == 1 and "in.tar (member #2 '0001.bin')" in err and "refused" in err, err
    assert "Traceback" not in err
    assert not os.path.exists(os.path.join(out, "index.json"))
    r = shardtool.pack(src, str(work / "o2"), skip_bad=True)
    assert r.samples == 2 and len(r.skipped) == 1
    after = files_under(tmp_path)
    created = {f for f in after - before if not f.startswith(("work/o/", "work/o2/"))}
    assert created == set(), created
    assert not os.path.lexists(tmp_path / "outside-target")
    # Nothing but regular files in the outputs: no link, device or FIFO was materialised.
    for d in (out, str(work / "o2")):
        for dp, _, files in os.walk(d):
            for n in files:
                st = os.lstat(os.path.join(dp, n))
                assert os.path.isfile(os.path.join(dp, n)) and not os.path.islink(os.path.join(dp, n)), n
                assert st.st_nlink == 1


def _huge_member_tar(path, declared: int) -> str:
    """A tar header declaring ``declared`` bytes, followed by only a few: never allocate on trust."""
    info = tarfile.TarInfo("0000.bin")
    info.size = declared
    head = info.tobuf(format=tarfile.GNU_FORMAT)
    with open(path, "wb") as f:
        f.write(head + b"\0" * 4096)
    return path


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["huge-declared", "tar.gz-bomb", "jsonl.zst-bomb"])
def test_bombs_refused_with_bounded_memory(tmp_path, kind):
    if kind == "huge-declared":
        src = _huge_member_tar(str(tmp_path / "huge.tar"), 64 << 30)
        pattern = r"huge\.tar \(member #1 '0000\.bin'\): member declares \d+ bytes, over the"
    elif kind == "tar.gz-bomb":
        # 256 MiB of zeros as one member (16x the limit below), about 0.25 MB compressed.
        src = str(tmp_path / "bomb.tar.gz")
        with gzip.open(src, "wb", compresslevel=1) as gz:
            info = tarfile.TarInfo("0000.bin")
            info.size = 256 << 20
            gz.write(info.tobuf(format=tarfile.GNU_FORMAT))
            zero = b"\0" * (1 << 20)
            for _ in range(256):
                gz.write(zero)
        pattern = r"bomb\.tar\.gz \(member #1 '0000\.bin'\): member declares"
    else:
        import zstandard

        src = str(tmp_path / "bomb.jsonl.zst")
        with open(src, "wb") as f, zstandard.ZstdCompressor(level=3).stream_writer(f) as w:
            chunk = b"0" * (1 << 20)
            for _ in range(512):  # 512 MiB without a newline
                w.write(chunk)
        pattern = r"bomb\.jsonl\.zst \(line 1\): line is longer than"
    assert os.path.getsize(src) < 64 << 20
    before = files_under(tmp_path)
    rc, err, peak_mib = _run_measured(
        ["pack", src, "-o", str(tmp_path / "o"), "-q", "--max-sample-bytes", "16MiB"], cwd=str(tmp_path)
    )
    import re

    assert rc == 1 and re.search(pattern, err), err
    assert peak_mib < 300, f"peak RSS {peak_mib} MiB"
    assert {f for f in files_under(tmp_path) - before if not f.startswith("o/")} == set()
    assert not os.path.exists(tmp_path / "o" / "index.json")


# ------------------------------------------------------------------------------------ pickle
class Marker:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["tar", "arrow"])
@pytest.mark.parametrize("ext", ["pyd", "pickle"])
def test_pickle_member_never_unpickled_through_pack_and_read(tmp_path, fmt, ext):
    marker = tmp_path / "MARKER"
    payload = pickle.dumps(Marker(marker))
    src = write_tar(
        str(tmp_path / "in.tar"),
        [("0000.txt", b"hello"), (f"0000.{ext}", payload), ("0001.txt", b"bye"), (f"0001.{ext}", payload)],
    )
    out = str(tmp_path / "o")
    r = shardtool.pack(src, out, format=fmt)
    assert r.samples == 2 and not marker.exists()
    # Asking for a length from the pickled field must not unpickle either; the error names the input.
    with pytest.raises(ShardtoolError, match=r"in\.tar \(member '0000\..*'\).*pickled"):
        shardtool.pack(src, str(tmp_path / "o2"), format=fmt, length=ext)
    assert not marker.exists()
    p = cli("pack", src, "-o", str(tmp_path / "o3"), "-q", "--format", fmt, "--length", ext)
    assert p.returncode == 1 and "in.tar" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not marker.exists()
    ds = shardtool.open_dataset(out)
    with pytest.raises(PickleRefusedError, match=rf"sample #0 field '{ext}'"):
        ds.read(0, 0)
    assert ds.read(0, 0, decode=False)["txt"] == b"hello"
    assert not marker.exists()
    assert cli("verify", out).returncode == 0 and not marker.exists()
    cli("inspect", out)
    assert not marker.exists()
    ds.close()
    with shardtool.open_dataset(out, allow_pickle=True) as ds2:  # the explicit opt-in
        ds2.read(0, 0)
    assert marker.exists()


# ------------------------------------------------------------------------------------ disk full
@pytest.fixture
def tiny_fs(tmp_path):
    with tmpfs(tmp_path / "tiny", "size=1m") as d:
        yield d


def _published_shards_complete(out) -> int:
    """Every published shard has its index, and the index accounts for every byte: none truncated."""
    shard_dir = os.path.join(out, "shards")
    n = 0
    for name in sorted(os.listdir(shard_dir)) if os.path.isdir(shard_dir) else []:
        if name.endswith(".idx.arrow") or not name.endswith((".tar", ".arrow")):
            continue
        idx_path = os.path.join(shard_dir, name.rsplit(".", 1)[0] + ".idx.arrow")
        assert os.path.exists(idx_path), f"{name} published without its index"
        data = open(idx_path, "rb").read()
        idx = ShardIndex.from_bytes(data, ["tokens", "text", "label"], shard=name, tar=name.endswith(".tar"))
        size = os.path.getsize(os.path.join(shard_dir, name))
        end = int((idx.offsets + idx.sizes).max())
        assert (end + 1024 == size) if name.endswith(".tar") else (end < size), (name, end, size)
        n += 1
    return n


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fmt", ["tar", "arrow"])
@pytest.mark.parametrize("workers", [1, 2])
def test_disk_full_during_pack(tmp_path, tiny_fs, fmt, workers):
    src = write_jsonl(str(tmp_path / "in.jsonl"), token_records(6000, max_len=120))
    out = str(tiny_fs / "o")
    p = cli("pack", src, "-o", out, "-q", "--format", fmt, "--samples-per-shard", "500", "--workers", str(workers))
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert "No space left" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not os.path.exists(os.path.join(out, "index.json"))
    assert temps(tiny_fs) == [], temps(tiny_fs)
    _published_shards_complete(out)
