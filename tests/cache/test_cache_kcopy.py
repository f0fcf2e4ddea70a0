"""cache/kcopy.py: the in-kernel copy of a local shard, each method and the fallbacks between them."""

import os

import pytest

from helpers.skips import require
from shardtool.cache.kcopy import METHODS, STEP, copy_range


def _files(tmp_path, data, src_dir=None):
    sp = os.path.join(src_dir or str(tmp_path), "src.bin")
    with open(sp, "wb") as f:
        f.write(data)
    return os.open(sp, os.O_RDONLY), os.open(str(tmp_path / "dst.bin"), os.O_RDWR | os.O_CREAT | os.O_TRUNC)


def _read(fd):
    return os.pread(fd, os.fstat(fd).st_size + 1, 0)


@pytest.mark.parametrize("name", [n for n, _ in METHODS])
@pytest.mark.parametrize("size", [0, 1, 4096 + 3, STEP + 12345])
def test_each_method_copies_exactly(tmp_path, name, size):
    data = os.urandom(min(size, 1 << 16)) * (size // (1 << 16) + 1)
    data = data[:size]
    sfd, dfd = _files(tmp_path, data)
    steps = []
    try:
        n = copy_range(sfd, dfd, size, on_step=steps.append, methods=[m for m in METHODS if m[0] == name])
        assert n == size and sum(steps) == size and _read(dfd) == data
        if size > STEP:
            assert len(steps) >= 2  # progress (and the deadline check) runs between steps
    finally:
        os.close(sfd)
        os.close(dfd)


@pytest.mark.parametrize("name", [n for n, _ in METHODS])
def test_a_source_shorter_than_asked_returns_what_it_had(tmp_path, name):
    sfd, dfd = _files(tmp_path, b"x" * 1000)
    try:
        assert copy_range(sfd, dfd, 5000, methods=[m for m in METHODS if m[0] == name]) == 1000
        assert _read(dfd) == b"x" * 1000
    finally:
        os.close(sfd)
        os.close(dfd)


def test_across_filesystems_falls_back_and_copies_exactly(tmp_path):
    # /dev/shm is a tmpfs: copy_file_range between it and the test's disk is refused by most
    # kernels (EXDEV), as between Lustre/GPFS and a node's NVMe; the next method must take over.
    shm = "/dev/shm"
    require(
        os.path.isdir(shm) and os.stat(shm).st_dev != os.stat(str(tmp_path)).st_dev, "no second filesystem at /dev/shm"
    )
    d = os.path.join(shm, f"kcopy-test-{os.getpid()}")
    os.makedirs(d, exist_ok=True)
    data = os.urandom(3 << 20)
    sfd, dfd = _files(tmp_path, data, src_dir=d)
    try:
        assert copy_range(sfd, dfd, len(data)) == len(data) and _read(dfd) == data
    finally:
        os.close(sfd)
        os.close(dfd)
        os.unlink(os.path.join(d, "src.bin"))
        os.rmdir(d)


@pytest.mark.parametrize("size", [0, 1, (16 << 20) + 7])
def test_hashing_the_copy_by_mmap_or_by_reads_agrees_with_the_manifest_hash(tmp_path, size):
    from shardtool.cache.store import hash_fd
    from shardtool.format.hashing import hash_bytes

    data = (os.urandom(1 << 16) * (size // (1 << 16) + 1))[:size]
    p = tmp_path / "f"
    p.write_bytes(data)
    fd = os.open(str(p), os.O_RDONLY)
    try:
        assert hash_fd(fd, size) == hash_fd(fd, size, use_mmap=False) == hash_bytes(data)
    finally:
        os.close(fd)


def test_a_method_that_silently_copies_nothing_is_not_taken_for_the_end(tmp_path):
    # Some kernel/filesystem pairs answer copy_file_range with 0 bytes instead of an error; the
    # shard must still be copied whole by the next method, not reported short.
    data = os.urandom(100_000)
    sfd, dfd = _files(tmp_path, data)
    try:
        assert copy_range(sfd, dfd, len(data), methods=[("copies nothing", lambda *a: 0)] + METHODS) == len(data)
        assert _read(dfd) == data
    finally:
        os.close(sfd)
        os.close(dfd)
