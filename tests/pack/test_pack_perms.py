"""Published datasets follow the user's umask: a dataset on a shared filesystem is read by others.

Each pack runs in its own process with the umask set there (the umask is process-wide, so it is
never changed in the test process itself).
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from helpers.data_gen import token_records, write_jsonl
from helpers.runcli import repo_env

PACK = """
import os, sys
os.umask(int(sys.argv[1], 8))
import shardtool
from shardtool.pack import merge
src, out, fmt = sys.argv[2], sys.argv[3], sys.argv[4]
shardtool.pack(src, out + "/single", format=fmt, samples_per_shard=7, workers=2)
for t in range(2):  # a job array: fragments, then the merged manifest
    shardtool.pack(src, out + "/array", format=fmt, samples_per_shard=7, num_tasks=2, task_index=t)
merge(out + "/array")
"""


def _modes(root: str) -> dict[str, int]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, root)] = stat.S_IMODE(os.lstat(path).st_mode)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["tar", "arrow"])
@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_published_files_follow_the_umask(tmp_path, umask, fmt):
    src = write_jsonl(str(tmp_path / "in.jsonl"), token_records(30))
    out = tmp_path / "out"
    subprocess.run(
        [sys.executable, "-c", PACK, f"{umask:o}", src, str(out), fmt], env=repo_env(), check=True, timeout=100
    )
    modes = _modes(str(out))
    files = {p: m for p, m in modes.items() if not os.path.isdir(out / p)}
    dirs = {p: m for p, m in modes.items() if os.path.isdir(out / p)}
    # Everything a reader needs is there: manifests, lengths, shards, sample indexes, fragments.
    for must in (
        "single/index.json",
        "single/lengths.npy",
        "array/index.json",
        "array/lengths.npy",
        "array/tasks/task-0001-of-0002.json",
    ):
        assert must in files
    assert any(p.endswith(".idx.arrow") for p in files) and any(p.endswith("." + fmt) for p in files)
    assert not [p for p in files if os.path.basename(p).startswith(".tmp-")]
    want_file, want_dir = 0o666 & ~umask, 0o777 & ~umask
    wrong = {p: oct(m) for p, m in files.items() if m != want_file}
    assert not wrong, f"files not {oct(want_file)} under umask {umask:03o}: {wrong}"
    wrong = {p: oct(m) for p, m in dirs.items() if m != want_dir}
    assert not wrong, f"directories not {oct(want_dir)} under umask {umask:03o}: {wrong}"
