"""A cache warmed by root (the SLURM prolog) serves the job's user, who cannot write it.

Two real users: the cache is warmed as root, as examples/slurm/prolog.sh does, under the
tightest umask a prolog may have; the loader then runs as uid 65534 in a forked child, with the
source reachable and with it gone. Reading must need no write access to the cache; a shard the
cache lacks is fetched into the user's own fallback cache, with one warning.
"""

from __future__ import annotations

import concurrent.futures
import grp
import os
import shutil
import stat
import time
import warnings

import pytest

from helpers.asuser import NOBODY, make_readable, preload, require_root, run_as, shared_tmpdir
from helpers.runcli import shardtool_cli
from shardtool import cache
from shardtool.cache import admin
from shardtool.format import open_dataset
from shardtool.format.hashing import hash_file
from shardtool.loader import ShardedLoader
from shardtool.plan import DataLayout, Layout, Placement, shards_for_node
from test_loader_data import read_all, write_dataset

pytestmark = pytest.mark.timeout(240)

SHARDS = [37, 5, 60, 22, 41, 13, 50, 8, 33, 29, 44, 17, 26, 35]  # 14 uneven shards on 2 nodes
# Everything the child needs, imported before it drops privileges (see tests/helpers/asuser.py).
preload("shardtool.cache.admin", "fsspec.implementations.local", "shardtool.format.tarshard", "shardtool.loader.pool")


def _loader(url, cache_dir, rank):
    # No workers: a worker start method other than fork would exec the interpreter as the other
    # user, who may not be allowed to (the cold-cache tests cover workers).
    return ShardedLoader(
        url, max_tokens=256, seed=3, rank=rank, world_size=4, ranks_per_node=2, num_workers=0, cache_dir=cache_dir
    )


def _snapshot(root):
    """What a reader must not change: every path with its mode, owner, size and mtime."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(d, name)
            st = os.lstat(p)
            out[os.path.relpath(p, root)] = (st.st_mode, st.st_uid, st.st_gid, st.st_size, st.st_mtime_ns)
    return out


def _modes(root):
    """{relative path: permission bits} of every directory and file under ``root``."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(d, name)
            out[os.path.relpath(p, root)] = (stat.S_IMODE(os.lstat(p).st_mode), os.path.isdir(p))
    return out


def read_as_user(src, cache_dir, ranks):
    """The job's read path: the loader for ``ranks``, then every shard through open_cache."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = {r: read_all(_loader(src, cache_dir, r)) for r in ranks}
        c = cache.open_cache(src, cache_dir)
        shards = {}
        for i, info in enumerate(c.manifest.shards):
            try:
                with c.reading(i) as path:
                    shards[i] = hash_file(path)[0] == info.hash
            except cache.NotCached as e:
                shards[i] = f"NotCached: {e}"
    return batches, shards, [str(w.message) for w in caught]


@pytest.fixture
def site():
    """A source every user can read, and a cache dir warmed by root with node 0's shards."""
    require_root()
    base = shared_tmpdir("shardtool-perms-")
    try:
        src, _ = write_dataset(os.path.join(base, "src"), SHARDS)
        make_readable(src)
        cache_dir = os.path.join(base, "cache")
        old = os.umask(0o077)  # the prolog's umask must not decide who can read the cache
        try:
            r = cache.warm(src, cache_dir, placement=Placement(Layout(2, 2), 0), progress=False)
        finally:
            os.umask(old)
        assert r.exit_code == 0 and r.shards_copied > 0, r.summary()
        tmp = os.path.join(base, "tmp")  # the job's TMPDIR
        os.mkdir(tmp)
        os.chmod(tmp, 0o1777)
        ds = open_dataset(src)
        node0 = set(shards_for_node(ds.summaries, DataLayout.pure_dp(Layout(2, 1)), 0))
        expected = {r: read_all(_loader(src, None, r)) for r in range(4)}
        yield {
            "base": base,
            "src": src,
            "cache": cache_dir,
            "tmp": tmp,
            "node0": node0,
            "expected": expected,
            "num_shards": len(SHARDS),
        }
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_root_warmed_cache_is_readable_by_everyone_whatever_the_umask(site):
    modes = _modes(site["cache"])
    assert modes, "nothing was cached"
    modes["."] = (stat.S_IMODE(os.stat(site["cache"]).st_mode), True)  # warm created the cache dir too
    wrong = {p: oct(m) for p, (m, is_dir) in modes.items() if m != (0o755 if is_dir else 0o644)}
    assert not wrong, f"not 0755 (dirs) / 0644 (files): {wrong}"


def test_the_jobs_user_reads_a_root_warmed_cache_with_the_source_reachable_then_gone(site):
    src, cdir, env = site["src"], site["cache"], {"TMPDIR": site["tmp"]}
    before = _snapshot(cdir)
    # rank 0 is on node 0 (all cached); rank 2 is on node 1, whose shards the cache lacks
    batches, shards, warns = run_as(read_as_user, src, cdir, [0, 2], env=env)
    assert batches == {r: site["expected"][r] for r in (0, 2)}
    assert shards == {i: True for i in range(site["num_shards"])}
    not_writable = [w for w in warns if "not writable" in w]
    assert len(not_writable) == 1 and cdir in not_writable[0], warns  # one warning, naming the cache
    assert _snapshot(cdir) == before  # a reader writes nothing into the shared cache

    # the misses went to the user's own cache, which nobody else can write
    fallback = os.path.join(site["tmp"], f"shardtool-cache-{NOBODY}")
    st = os.stat(fallback)
    assert st.st_uid == NOBODY and stat.S_IMODE(st.st_mode) & 0o022 == 0
    fetched = [f for _, _, fs in os.walk(fallback) for f in fs if f.endswith(".tar") and not f.startswith(".")]
    assert len(fetched) == site["num_shards"] - len(site["node0"])

    shutil.move(src, src + ".gone")  # the parallel filesystem goes away
    batches, shards, warns = run_as(read_as_user, src, cdir, [0, 1], env=env)
    assert batches == {r: site["expected"][r] for r in (0, 1)}
    # node 0's shards from the root-warmed cache, the rest from the user's fallback
    assert shards == {i: True for i in range(site["num_shards"])}
    assert _snapshot(cdir) == before


def test_offline_with_nothing_fetched_before_only_the_missing_shards_fail_clearly(site):
    src, cdir = site["src"], site["cache"]
    shutil.move(src, src + ".gone")
    batches, shards, _ = run_as(read_as_user, src, cdir, [0, 1], env={"TMPDIR": site["tmp"]})
    assert batches == {r: site["expected"][r] for r in (0, 1)}
    for i in range(site["num_shards"]):
        if i in site["node0"]:
            assert shards[i] is True
        else:
            assert shards[i].startswith("NotCached") and "Permission" not in shards[i], shards[i]


def test_warm_mode_and_group_make_a_tighter_cache_the_group_can_read(site):
    src, cdir = site["src"], os.path.join(site["base"], "tight")
    group = grp.getgrgid(NOBODY).gr_name
    res = shardtool_cli("warm", src, "--cache-dir", cdir, "--all", "--quiet", "--mode", "0640", "--group", group)
    assert res.returncode == 0, res.stderr
    for rel, (mode, is_dir) in _modes(cdir).items():
        assert mode == (0o750 if is_dir else 0o640), (rel, oct(mode))
        assert os.stat(os.path.join(cdir, rel)).st_gid == NOBODY, rel
    batches, shards, warns = run_as(read_as_user, src, cdir, [0, 3], env={"TMPDIR": site["tmp"]})
    assert batches == {r: site["expected"][r] for r in (0, 3)}
    assert shards == {i: True for i in range(site["num_shards"])}
    assert not [w for w in warns if "writable" in w]


@pytest.mark.parametrize("bad", ["0x1", "0o1000", "0400", "0755", "rw-r-----"])
def test_warm_refuses_a_mode_that_is_not_a_file_mode_the_owner_can_write(site, bad):
    res = shardtool_cli("warm", site["src"], "--cache-dir", os.path.join(site["base"], "c2"), "--all", "--mode", bad)
    assert res.returncode == 2 and "--mode" in res.stderr, res.stderr


def hold_while(src, cache_dir, shard, flag_dir):
    """Read ``shard`` as the job's user and keep it open until the test says ``release``."""
    c = cache.open_cache(src, cache_dir)
    with c.reading(shard):
        open(os.path.join(flag_dir, "holding"), "w").close()
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(flag_dir, "release")):
            if time.monotonic() > deadline:
                raise TimeoutError("never released")
            time.sleep(0.02)
    return True


def test_a_reader_that_cannot_write_the_cache_still_keeps_eviction_away(site):
    shard = min(site["node0"])
    flags = os.path.join(site["tmp"], "flags")
    os.mkdir(flags)
    os.chmod(flags, 0o777)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(run_as, hold_while, site["src"], site["cache"], shard, flags, env={"TMPDIR": site["tmp"]})
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(flags, "holding")):
            assert time.monotonic() < deadline and not held.done(), held.result() if held.done() else "no start"
            time.sleep(0.02)
        # root clears the cache while the user reads: the shard being read stays (its shared lock,
        # taken on a read-only descriptor, is seen by the writer)
        res = admin.clear(site["cache"])
        open(os.path.join(flags, "release"), "w").close()
        assert held.result() is True
    ds = open_dataset(site["src"])
    path = cache.VersionDir(site["cache"], ds.version).path(ds.manifest.shards[shard].path)
    assert res["busy"] == [path] and os.path.exists(path)


def _perms_for(mode, group):
    import argparse

    from shardtool.cli.cmd_warm import perms_from

    try:
        return perms_from(argparse.Namespace(mode=mode, group=group))
    except ValueError as e:
        return str(e)


def test_warm_group_must_be_one_the_warming_user_can_give_files_to(site):
    root_group = grp.getgrgid(0).gr_name
    assert _perms_for("0640", root_group) == cache.Perms(0o640, 0)  # root may use any group
    # another user may not: refused up front (exit 2), not a local fault halfway through the warm
    refused = run_as(_perms_for, "0640", root_group)
    assert isinstance(refused, str) and "--group" in refused and "member" in refused
    assert run_as(_perms_for, "0640", grp.getgrgid(NOBODY).gr_name) == cache.Perms(0o640, NOBODY)
