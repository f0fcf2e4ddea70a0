"""A shard read in place (a local dataset, no cache) is verified before any of it is served.

One flipped byte in a tar or Arrow shard must stop the loader with an error naming the shard and
the damaged sample, on every worker count, before a batch with that byte reaches the training loop.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from helpers.fsutil import flip_byte
from shardtool.format import FormatError, open_dataset
from shardtool.loader import ShardedLoader
from test_loader_data import write_dataset

SHARD, SAMPLE = 1, 7  # the damaged sample: #7 of shard-00001


def _token_offset(ds, shard: int, i: int) -> int:
    """A byte inside the token payload of sample ``i`` (tar) or inside its record batch (arrow)."""
    idx = ds.shard_index(shard)
    if ds.manifest.shard_format == "tar":
        j = ds.manifest.field_names.index("tokens")
        return int(idx.offsets[i]) + int(idx.field_offsets[i, j]) + int(idx.field_sizes[i, j]) - 2
    return int(idx.offsets[i]) + int(idx.sizes[i]) // 2


def _damaged(tmp_path, fmt: str):
    root, keys = write_dataset(str(tmp_path / fmt), [20, 20, 20], fmt=fmt, lengths=np.full(60, 30))
    ds = open_dataset(root)
    clean = {s["__key__"]: s["tokens"].copy() for s in (ds.read(sh, i) for sh in range(3) for i in range(20))}
    flip_byte(ds.shard_path(SHARD), _token_offset(ds, SHARD, SAMPLE))
    return root, ds, clean


def _names_sample(msg: str, i: int) -> bool:
    """Whether ``msg`` names sample #i, alone or in a run '#a..#b' (an Arrow record batch)."""
    for a, b in re.findall(r"#(\d+)(?:\.\.#(\d+))?", msg):
        if int(a) <= i <= int(b or a):
            return True
    return False


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("fmt", ["tar", "arrow"])
def test_a_flipped_byte_stops_the_loader_naming_shard_and_sample(tmp_path, fmt, workers):
    root, ds, clean = _damaged(tmp_path, fmt)
    delivered = []
    ld = ShardedLoader(root, batch_size=4, num_workers=workers, pin_memory=False)
    with pytest.raises(FormatError) as info:
        for batch in ld:
            delivered.append(batch)
    msg = str(info.value)
    assert ds.manifest.shards[SHARD].path in msg and root in msg, msg  # the shard, of which dataset
    assert _names_sample(msg, SAMPLE), msg
    # Nothing corrupt reached the loop: every sample delivered before the error is intact.
    for batch in delivered:
        for r, key in enumerate(batch["__key__"]):
            n = int(batch["lengths"][r])
            assert np.array_equal(batch["tokens"][r, :n].numpy(), clean[key]), key


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["tar", "arrow"])
def test_custom_collation_reads_verified_bytes_too(tmp_path, fmt):
    root, ds, _ = _damaged(tmp_path, fmt)
    ld = ShardedLoader(root, batch_size=4, num_workers=0, collate_fn=lambda samples: samples)
    with pytest.raises(FormatError, match=re.escape(ds.manifest.shards[SHARD].path)):
        for _ in ld:
            pass


# --------------------------------------------------------------------------- trust stamps
def _clean(tmp_path, name="d"):
    root, _ = write_dataset(str(tmp_path / name), [20, 20], lengths=np.full(40, 30))
    return root, open_dataset(root)


def _restamp(verifier, shard: int, **change) -> None:
    """Rewrite a stamp so that it describes the shard file as it is now (plus ``change``)."""
    from shardtool.loader.verify import file_identity

    path = verifier.stamp_path(shard)
    with open(path) as f:
        stamp = json.load(f)
    stamp.update(file_identity(os.stat(verifier.dataset.shard_path(shard))), **change)
    with open(path, "w") as f:
        json.dump(stamp, f)


def _served(root, workers: int = 0) -> int:
    """Samples one pass of a loader over ``root`` serves."""
    return sum(len(b["__key__"]) for b in ShardedLoader(root, batch_size=4, num_workers=workers))


def _used_then_damaged(tmp_path, workers: int):
    """A clean dataset read once (so its shards are stamped), then a byte of shard 0 flipped (size
    kept; mtime and ctime move): (root, its stamps)."""
    from shardtool.loader.verify import InPlaceVerifier

    root, ds = _clean(tmp_path)
    assert _served(root, workers) == 40
    verifier = InPlaceVerifier(ds)
    assert all(os.path.exists(verifier.stamp_path(s)) for s in range(ds.num_shards))
    flip_byte(ds.shard_path(0), _token_offset(ds, 0, 3))
    return root, verifier


@pytest.mark.timeout(60)
def test_every_shard_used_is_stamped_and_a_later_write_voids_its_stamp(tmp_path):
    root, _ = _used_then_damaged(tmp_path, workers=2)
    with pytest.raises(FormatError, match=r"shard-00000.tar.*#3"):
        _served(root)


@pytest.mark.timeout(60)
def test_a_stamp_vouches_only_for_the_file_it_saw_in_this_boot(tmp_path):
    from shardtool.cache.durability import boot_id

    root, verifier = _used_then_damaged(tmp_path, workers=0)
    # A stamp from another boot, even for the file's exact stat, is not trusted: hashed again.
    _restamp(verifier, 0, boot="an-earlier-boot")
    with pytest.raises(FormatError, match="shard-00000.tar"):
        _served(root)
    # A stamp of this boot for this exact file is what spares later processes the hash (here,
    # forged over a damaged file, it shows that the hash really is skipped).
    _restamp(verifier, 0, boot=boot_id())
    assert _served(root) == 40


@pytest.mark.timeout(60)
def test_stamps_in_a_directory_others_can_write_are_ignored(tmp_path):
    from shardtool.loader.source import MappedFile
    from shardtool.loader.verify import InPlaceVerifier

    root, ds = _clean(tmp_path)
    env = {"SHARDTOOL_USER_CACHE": str(tmp_path / "uc")}
    good = InPlaceVerifier(ds, env)
    mapped = MappedFile(ds.shard_path(0), "shard-00000.tar")
    good.check(0, mapped.buffer(), mapped.stat)
    mapped.close()
    flip_byte(ds.shard_path(0), _token_offset(ds, 0, 3))
    _restamp(good, 0)  # a planted stamp for the damaged file ...
    os.chmod(tmp_path / "uc", 0o777)  # ... in a directory anyone could have written it to
    mapped = MappedFile(ds.shard_path(0), "shard-00000.tar")
    try:
        planted = InPlaceVerifier(ds, env)
        assert planted.dir is None
        with pytest.raises(FormatError, match=r"shard-00000.tar.*#3"):
            planted.check(0, mapped.buffer(), mapped.stat)
    finally:
        mapped.close()
