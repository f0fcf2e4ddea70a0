"""Fault suite, format layer: hand-made datasets a packer would never write must be refused at read.

Each dataset here is built by hand (tar/Arrow bytes, sample index, manifest) without going
through ``pack``, so these tests show what a *reader* does with a hostile or broken dataset:
a clear error naming the shard (or manifest), from the API and from ``shardtool verify`` /
``shardtool inspect`` (exit code ≠ 0), and never an unpickle, never wrong lengths.
"""

from __future__ import annotations

import io
import json
import os
import pickle

import numpy as np
import pytest

import shardtool
from helpers.runcli import shardtool_cli as cli
from shardtool.format import FieldSpec, FormatError, Manifest, ShardIndex, ShardInfo, open_dataset
from shardtool.format.arrowshard import ArrowShardWriter
from shardtool.format.hashing import hash_bytes
from shardtool.format.manifest import LENGTHS_NAME, MANIFEST_NAME, length_summary, lengths_to_bytes
from shardtool.format.tarshard import TarShardWriter
from shardtool.format.writer import publish_manifest
from shardtool.pack.verify import verify

SHARD = "shards/hand-000000.tar"
ASHARD = "shards/hand-000000.arrow"


class Marker:
    """Unpickling this creates ``path``: proof that something unpickled shard data."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _publish_shard(root, rel, data: bytes, idx: ShardIndex, fields: list[FieldSpec]) -> ShardInfo:
    os.makedirs(os.path.join(root, os.path.dirname(rel)), exist_ok=True)
    with open(os.path.join(root, rel), "wb") as f:
        f.write(data)
    index_rel = rel.rsplit(".", 1)[0] + ".idx.arrow"
    index_bytes = idx.to_bytes([f.name for f in fields])
    with open(os.path.join(root, index_rel), "wb") as f:
        f.write(index_bytes)
    return ShardInfo(rel, len(idx), len(data), hash_bytes(data), index_rel, len(index_bytes), hash_bytes(index_bytes))


def handmade_tar(
    root, samples: list[tuple[str, list[bytes]]], fields: list[FieldSpec], *, lengths=None, rel=SHARD
) -> str:
    """A tar dataset written byte by byte, keys unchecked; lengths default to payload bytes."""
    buf = io.BytesIO()
    w = TarShardWriter(buf, [f.ext for f in fields])
    entries = [w.write(k, p) for k, p in samples]
    w.close()
    n = len(samples)
    real = np.array([sum(len(p) for p in ps) for _, ps in samples], dtype=np.int64)
    idx = ShardIndex(
        [k for k, _ in samples],
        np.array([e.offset for e in entries], np.uint64),
        np.array([e.size for e in entries], np.uint64),
        real if lengths is None else np.asarray(lengths, np.int64),
    )
    idx.field_offsets = np.array([e.field_offsets for e in entries], np.uint32).reshape(n, len(fields))
    idx.field_sizes = np.array([e.field_sizes for e in entries], np.uint64).reshape(n, len(fields))
    info = _publish_shard(root, rel, buf.getvalue(), idx, fields)
    publish_manifest(
        str(root),
        Manifest("tar", fields, [info], {"field": None, "unit": "bytes", "fn": None}),
        real if lengths is None else idx.lengths,
    )
    return str(root)


def handmade_arrow(
    root, keys: list[str], tokens: list[list[int]], *, file_dtype="i8", manifest_dtype="i8", index_lengths=None
) -> str:
    """An Arrow dataset whose shard is written with ``file_dtype`` tokens, its manifest saying ``manifest_dtype``."""
    file_fields = [FieldSpec("tokens", "tokens.npy", "npy", "array", file_dtype)]
    fields = [FieldSpec("tokens", "tokens.npy", "npy", "array", manifest_dtype)]
    buf = io.BytesIO()
    w = ArrowShardWriter(buf, file_fields)
    where = [w.write(k, [np.asarray(t, dtype=np.dtype(file_dtype))], 8 * len(t)) for k, t in zip(keys, tokens)]
    w.close()
    ranges = np.array(w.batch_ranges, np.uint64).reshape(-1, 2)
    b = np.array([x[0] for x in where], np.int64)
    real = np.array([len(t) for t in tokens], np.int64)
    idx = ShardIndex(
        list(keys), ranges[b, 0], ranges[b, 1], real if index_lengths is None else np.asarray(index_lengths, np.int64)
    )
    idx.batch = b.astype(np.int32)
    idx.row = np.array([x[1] for x in where], np.int32)
    info = _publish_shard(root, ASHARD, buf.getvalue(), idx, fields)
    publish_manifest(
        str(root), Manifest("arrow", fields, [info], {"field": "tokens", "unit": "elements", "fn": None}), real
    )
    return str(root)


def _assert_refused_everywhere(root, shard: str, pattern: str):
    """API read, shard_index, verify and both CLIs refuse, each naming the shard."""
    ds = open_dataset(root)
    with pytest.raises(FormatError, match=pattern) as e:
        ds.read(0, 0)
    assert shard in str(e.value)
    with pytest.raises(FormatError, match=pattern):
        ds.shard_index(0)
    ds.close()
    rep = verify(root)
    assert not rep["ok"] and [b["shard"] for b in rep["bad"]] == [shard], rep
    for cmd in ("verify", "inspect"):
        p = cli(cmd, root)
        assert p.returncode != 0, (cmd, p.stdout, p.stderr)
        assert shard in p.stderr and "Traceback" not in p.stderr, (cmd, p.stderr)


BAD_KEYS = {
    "dotdot": "../evil",
    "absolute": "/etc/evil",
    "backslash": "a\\b",
    "nul": "a\x00b",
    "newline": "a\nb",
    "long": "k" * 300,
}
RAW = [FieldSpec.raw("bin")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(BAD_KEYS))
def test_handmade_index_with_bad_key_is_refused_at_read(tmp_path, name):
    root = handmade_tar(tmp_path / "ds", [("good", [b"ok"]), (BAD_KEYS[name], [b"evil"])], RAW)
    _assert_refused_everywhere(root, SHARD, "key")


@pytest.mark.timeout(120)
def test_handmade_index_with_duplicate_keys_is_refused_at_read(tmp_path):
    root = handmade_tar(tmp_path / "ds", [("a", [b"1"]), ("b", [b"2"]), ("a", [b"3"])], RAW)
    _assert_refused_everywhere(root, SHARD, "duplicate key 'a'")


def _rewrite_manifest(root, edit) -> None:
    path = os.path.join(root, MANIFEST_NAME)
    with open(path) as f:
        d = json.load(f)
    edit(d)
    with open(path, "w") as f:
        json.dump(d, f)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["path", "index"])
@pytest.mark.parametrize("bad", ["../outside.tar", "/tmp/outside.tar", "shards/../../outside.tar"])
def test_manifest_path_escaping_root_is_refused_at_open(tmp_path, where, bad):
    root = handmade_tar(tmp_path / "ds", [("a", [b"1"])], RAW)
    # Something really is there, so a reader that followed the path would find a file.
    with open(tmp_path / "outside.tar", "wb") as f:
        f.write(open(os.path.join(root, SHARD), "rb").read())

    def edit(d):
        d["shards"][0][where] = bad

    _rewrite_manifest(root, edit)
    with pytest.raises(FormatError, match=r"shard #0.*(escapes|not relative)"):
        open_dataset(root)
    for cmd in ("verify", "inspect"):
        p = cli(cmd, root)
        assert p.returncode == 1 and bad in p.stderr and "shard #0" in p.stderr, (cmd, p.stderr)
        assert "Traceback" not in p.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cut", [0, 1, 40, -2])
def test_truncated_manifest_is_a_clear_error(tmp_path, cut):
    root = handmade_tar(tmp_path / "ds", [("a", [b"1"]), ("b", [b"2"])], RAW)
    path = os.path.join(root, MANIFEST_NAME)
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[:cut])
    with pytest.raises(FormatError, match=MANIFEST_NAME):
        open_dataset(root)
    for cmd in ("verify", "inspect"):
        p = cli(cmd, root)
        assert p.returncode == 1 and MANIFEST_NAME in p.stderr and "Traceback" not in p.stderr, (cmd, p.stderr)


@pytest.mark.timeout(120)
def test_truncated_sample_index_names_the_shard(tmp_path):
    root = handmade_tar(tmp_path / "ds", [("a", [b"1"]), ("b", [b"2"])], RAW)
    ipath = os.path.join(root, SHARD.replace(".tar", ".idx.arrow"))
    data = open(ipath, "rb").read()
    with open(ipath, "wb") as f:
        f.write(data[: len(data) // 2])
    _assert_refused_everywhere(root, SHARD, "index")


# ------------------------------------------------------------------------------------ pickle
@pytest.mark.timeout(120)
@pytest.mark.parametrize("ext", ["pyd", "pickle"])
def test_pickled_member_is_never_unpickled_on_read(tmp_path, ext):
    marker = tmp_path / "MARKER"
    payload = pickle.dumps(Marker(marker))
    root = handmade_tar(tmp_path / "ds", [("a", [payload])], [FieldSpec.raw(ext)])
    ds = open_dataset(root)
    with pytest.raises(shardtool.format.PickleRefusedError, match=rf"{SHARD} sample #0 field '{ext}'.*pickled"):
        ds.read(0, 0)
    assert bytes(ds.read(0, 0, decode=False)[ext]) == payload  # raw bytes are fine
    assert not marker.exists()
    assert verify(root)["ok"] and not marker.exists()  # verify checks bytes, never decodes
    p = cli("inspect", root)
    assert not marker.exists(), p.stderr
    ds.close()
    # The explicit opt-in does unpickle: proof the payload above was live.
    with open_dataset(root, allow_pickle=True) as ds2:
        ds2.read(0, 0)
    assert marker.exists()


@pytest.mark.timeout(60)
def test_object_npy_member_and_lengths_never_unpickled(tmp_path):
    marker = tmp_path / "MARKER"
    buf = io.BytesIO()
    np.save(buf, np.array([Marker(marker), 1], dtype=object), allow_pickle=True)
    root = handmade_tar(tmp_path / "ds", [("a", [buf.getvalue()])], [FieldSpec.raw("npy")])
    ds = open_dataset(root, allow_pickle=False)
    with pytest.raises(shardtool.format.PickleRefusedError, match="Python objects"):
        ds.read(0, 0)
    # A lengths.npy holding pickled objects (manifest hash updated to match) is refused too.
    lpath = os.path.join(root, LENGTHS_NAME)
    with open(lpath, "wb") as f:
        f.write(buf.getvalue())

    def edit(d):
        d["lengths"].update(hash=hash_bytes(buf.getvalue()), bytes=len(buf.getvalue()))

    _rewrite_manifest(root, edit)
    with pytest.raises(FormatError):
        _ = open_dataset(root).lengths
    assert not marker.exists()


# ------------------------------------------------------------------------------------ Arrow / lengths
@pytest.mark.timeout(120)
def test_arrow_shard_schema_disagreeing_with_manifest_is_refused(tmp_path):
    keys = ["a", "b", "c"]
    tokens = [[1, 2], [3], [4, 5, 6]]
    good = handmade_arrow(tmp_path / "good", keys, tokens)
    with open_dataset(good) as ds:
        assert ds.read(0, 2)["tokens"].tolist() == [4, 5, 6]
    assert verify(good)["ok"]
    root = handmade_arrow(tmp_path / "ds", keys, tokens, file_dtype="i4", manifest_dtype="i8")
    _assert_refused_everywhere_arrow(root, "schema disagrees")


def _assert_refused_everywhere_arrow(root, pattern):
    with open_dataset(root) as ds:
        with pytest.raises(FormatError, match=pattern) as e:
            ds.read(0, 0)
        assert ASHARD in str(e.value)
    rep = verify(root)
    assert not rep["ok"] and [b["shard"] for b in rep["bad"]] == [ASHARD], rep
    for cmd in ("verify", "inspect"):
        p = cli(cmd, root)
        assert p.returncode != 0 and ASHARD in p.stderr and "Traceback" not in p.stderr, (cmd, p.stderr)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["tar", "arrow"])
def test_index_lengths_disagreeing_with_lengths_file_are_refused(tmp_path, fmt):
    """The index's length column and lengths.npy disagree, every hash consistent: never trusted."""
    if fmt == "arrow":
        root = handmade_arrow(tmp_path / "ds", ["a", "b"], [[1, 2], [3]], index_lengths=[2, 7])
        shard = ASHARD
    else:
        root = handmade_tar(tmp_path / "ds", [("a", [b"12"]), ("b", [b"3"])], RAW, lengths=[2, 7])
        shard = SHARD
        # handmade_tar wrote the same wrong lengths to lengths.npy; put the true ones there instead
        data = lengths_to_bytes(np.array([2, 1], np.int64))
        with open(os.path.join(root, LENGTHS_NAME), "wb") as f:
            f.write(data)

        def edit(d):
            d["lengths"].update(hash=hash_bytes(data), bytes=len(data))
            d["length"]["summary"] = length_summary(np.array([2, 1]))

        _rewrite_manifest(root, edit)
    with open_dataset(root) as ds:
        with pytest.raises(FormatError, match=rf"{shard}: sample lengths in the index disagree .*sample 1"):
            ds.shard_index(0)
        with pytest.raises(FormatError, match=shard):
            ds.read(0, 0)
    rep = verify(root)
    assert not rep["ok"] and rep["bad"][0]["shard"] == shard


@pytest.mark.timeout(60)
def test_lengths_file_disagreeing_with_manifest_summary_is_refused(tmp_path):
    """lengths.npy replaced (its hash updated) but the manifest's summary says otherwise: refused."""
    root = handmade_arrow(tmp_path / "ds", ["a", "b", "c"], [[1, 2], [3], [4, 5, 6]])
    data = lengths_to_bytes(np.array([2, 1, 30], np.int64))
    with open(os.path.join(root, LENGTHS_NAME), "wb") as f:
        f.write(data)

    def edit(d):
        d["lengths"].update(hash=hash_bytes(data), bytes=len(data))

    _rewrite_manifest(root, edit)
    with open_dataset(root) as ds:
        with pytest.raises(FormatError, match=LENGTHS_NAME):
            _ = ds.lengths
    rep = verify(root)
    assert not rep["ok"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["tar", "arrow"])
def test_length_field_disagreeing_with_recorded_lengths_fails_verify(tmp_path, fmt):
    """A consistent manifest + index whose lengths are not the length field's: verify names the shard."""
    from helpers.data_gen import token_records, write_jsonl

    out = str(tmp_path / "o")
    shardtool.pack(
        write_jsonl(str(tmp_path / "in.jsonl"), token_records(20)),
        out,
        format=fmt,
        samples_per_shard=10,
        length="tokens",
    )
    assert verify(out)["ok"]
    ds = open_dataset(out)
    info = ds.manifest.shards[1]
    idx = ds.shard_index(1)
    ds.close()
    idx.lengths = idx.lengths + 1  # every recorded length off by one
    index_bytes = idx.to_bytes(ds.manifest.field_names)
    with open(os.path.join(out, info.index), "wb") as f:
        f.write(index_bytes)
    lengths = ds.lengths.copy()
    lengths[10:20] += 1
    data = lengths_to_bytes(lengths)
    with open(os.path.join(out, LENGTHS_NAME), "wb") as f:
        f.write(data)

    def edit(d):
        d["lengths"].update(hash=hash_bytes(data), bytes=len(data))
        d["length"]["summary"] = length_summary(lengths)
        d["shards"][1].update(index_hash=hash_bytes(index_bytes), index_bytes=len(index_bytes))

    _rewrite_manifest(out, edit)
    rep = verify(out)
    assert not rep["ok"] and [b["shard"] for b in rep["bad"]] == [info.path], rep
    assert "length" in rep["bad"][0]["error"]
