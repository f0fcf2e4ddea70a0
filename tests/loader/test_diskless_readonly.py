"""No local disk (issue 38 item 3): a loader without a cache on a remote dataset writes nothing.

The loader runs in a mount namespace of its own where every filesystem is read-only but
/dev/shm (memory: the workers' batch slots and its temp directory, which must be empty after the
run) and the kernel's (/proc, /sys, /dev): the dataset's
origin is the S3 API server on 127.0.0.1 (moto), reached over the network, not a filesystem. An
epoch with 2 workers, plain and compressed Arrow shards and tar shards, must serve the batches a
local read serves; anything the loader tried to write (a cache, a temp file) would fail it, and
its memory-backed temp directory holds only its metric lines. Real text: stdlib files.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

import shardtool
from helpers.realtext import byte_ids, stdlib_files
from helpers.s3server import s3_server  # noqa: F401  (fixture)
from helpers.skips import require
from shardtool.loader import ShardedLoader

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEEP_WRITABLE = ("/dev/shm", "/proc", "/sys", "/dev")

# Every mount read-only but memory and the kernel's, the temp directory a fresh one in /dev/shm
# (memory: Python's tempfile, which torch's import asks for, needs one writable). Then the loader,
# and a list of what it left there. As root in a private mount namespace (unshare): nothing
# outside the test's process sees the change. (Not a tmpfs over /tmp: a checkout or an editable
# install under /tmp, as CI's clone is, would vanish under it.)
READ_ONLY = """
set -e
scratch=$(mktemp -d /dev/shm/shardtool-readonly.XXXXXX)
trap 'rm -rf "$scratch"' EXIT
awk '{print $2}' /proc/self/mounts | sort -u | while read -r m; do
  case "$m" in /dev/shm|/dev/shm/*|/proc|/proc/*|/sys|/sys/*|/dev|/dev/*) continue ;; esac
  mount -o remount,bind,ro "$m" 2>/dev/null || true
done
for d in "$PWD" /tmp /var/tmp "$HOME"; do
  if touch "$d/.shardtool-rw-probe" 2>/dev/null; then
    echo "$d stayed writable" >&2; exit 3
  fi
done
TMPDIR="$scratch" "$@"
echo "LEFT IN TMPDIR: $(cd "$scratch" && find . -mindepth 1 | sort | head -20 | tr '\\n' ' ')"
"""

LOADER = """
import json, sys
from shardtool.loader import ShardedLoader
url, options = sys.argv[1], json.loads(sys.argv[2])
ld = ShardedLoader(url, storage_options=options, batch_size=8, num_workers=2, seed=3, rank=0, world_size=1,
                   pin_memory=False)
print(json.dumps([[str(k) for k in b["__key__"]] for b in ld]))
ld.close()
"""


def _can_unshare() -> bool:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True, timeout=30)
    return probe.returncode == 0


@pytest.fixture(scope="module")
def remote(tmp_path_factory, s3_server):  # noqa: F811
    rows = [{"tokens": byte_ids(p), "path": os.path.relpath(p)} for p in stdlib_files(120)]
    out = {}
    for name, kw in {
        "arrow": dict(format="arrow"),
        "zstd": dict(format="arrow", compression="zstd"),
        "tar": dict(format="tar"),
    }.items():
        root = str(tmp_path_factory.mktemp(f"ro-{name}") / "ds")
        shardtool.pack(rows, root, length="tokens", shard_size=1_000_000, **kw)
        out[name] = (root, s3_server.upload(root, f"readonly/{name}"))
    return out, s3_server.storage_options


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["arrow", "zstd", "tar"])
def test_a_loader_without_a_cache_runs_on_a_read_only_machine(remote, kind):
    require(_can_unshare(), "needs root and unshare(1) for a private mount namespace (CI runs as root)")
    datasets, options = remote
    root, url = datasets[kind]
    local = ShardedLoader(root, batch_size=8, num_workers=0, seed=3, rank=0, world_size=1, metrics=False)
    want = [[str(k) for k in b["__key__"]] for b in local]
    env = {**os.environ, "PYTHONPATH": REPO, "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("SHARDTOOL_CACHE_DIR", None)
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", READ_ONLY, "sh"]
    cmd += [sys.executable, "-c", LOADER, url, json.dumps(options)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert res.returncode == 0, res.stderr[-4000:]
    lines = res.stdout.strip().splitlines()
    assert json.loads(lines[-2]) == want
    # Nothing in the memory-backed temp directory but the metric lines a loader writes there by
    # default (no cache, no temp file): one file, its pass's line (docs/observability.md).
    left = lines[-1].strip().removeprefix("LEFT IN TMPDIR:").split()
    files = [p for p in left if p.endswith(".jsonl")]
    assert len(left) == 3 and all(p.startswith("./shardtool-metrics") for p in left), lines[-1]  # 2 dirs, 1 file
    assert len(files) == 1 and files[0].count("/") == 3, lines[-1]
