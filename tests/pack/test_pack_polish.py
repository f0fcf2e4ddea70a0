"""What a new user meets first: help(shardtool.pack), iterating a Dataset, errors for a URL that
is not a dataset, verify naming the damaged sample, and a failed pack leaving nothing behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import shardtool
from helpers.data_gen import dir_digest, read_all, token_records, write_jsonl
from helpers.fsutil import flip_byte
from helpers.runcli import repo_env, shardtool_cli
from shardtool.format.errors import BadSampleError, FormatError, ShardtoolError
from shardtool.pack.verify import verify

HELP_CHECK = r"""
import inspect, pydoc, sys
import shardtool
assert "torch" not in sys.modules and "shardtool.pack.api" not in sys.modules, "import shardtool is not light"
sig = inspect.signature(shardtool.pack)
assert list(sig.parameters)[:2] == ["sources", "out"], sig
assert "skip_bad" in sig.parameters and sig.parameters["format"].default == "tar", sig
text = pydoc.render_doc(shardtool.pack, renderer=pydoc.plaintext)
assert "pack(sources" in text and "Pack ``sources``" in text, text
from shardtool.pack import merge  # importing the subpackage must not turn shardtool.pack into a module
import shardtool.pack
assert shardtool.pack is sys.modules["shardtool.pack.api"].pack and inspect.signature(shardtool.pack) == sig
print("ok")
"""


@pytest.mark.timeout(60)
def test_help_shows_the_real_signature_and_import_stays_light():
    r = subprocess.run([sys.executable, "-c", HELP_CHECK], env=repo_env(), capture_output=True, text=True, timeout=50)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fmt", ["tar", "arrow"])
def test_dataset_iterates_every_sample_in_order(tmp_path, fmt):
    recs = token_records(23)
    out = str(tmp_path / "o")
    shardtool.pack(write_jsonl(str(tmp_path / "in.jsonl"), recs), out, format=fmt, samples_per_shard=5, workers=2)
    ds = shardtool.open_dataset(out)
    assert len(ds) == 23 and ds.num_shards == 5
    first = [s["text"] for s in ds]
    assert first == [r["text"] for r in recs]  # dataset order is input order
    assert [s["__key__"] for s in ds] == list(read_all(out))  # and iterating twice gives it again
    assert [list(s["tokens"]) for s in ds] == [r["tokens"] for r in recs]


@pytest.mark.timeout(60)
def test_open_dataset_names_what_a_dataset_url_is(tmp_path):
    jsonl = write_jsonl(str(tmp_path / "data.jsonl"), token_records(3))
    cases = {
        "fiel:///data/ds": r"'fiel:///data/ds': unknown protocol 'fiel://'",
        jsonl: r"data\.jsonl' is a file, not a dataset",
        str(tmp_path): r"holds no index\.json",
        str(tmp_path / "nope"): r"nope' does not exist",
    }
    for url, pattern in cases.items():
        with pytest.raises(FormatError, match=pattern) as e:
            shardtool.open_dataset(url)
        assert "directory or object-store prefix holding index.json" in str(e.value)
        assert "shardtool pack" in str(e.value)
    p = shardtool_cli("inspect", jsonl)
    assert p.returncode != 0 and "is a file, not a dataset" in p.stderr and "Traceback" not in p.stderr
    mix = tmp_path / "mix.json"  # a mixture file given to a one-dataset command: not "pack it"
    mix.write_text('{"sources": {"a": {"url": "ds", "weight": 1}}}')
    for command in ("inspect", "verify"):
        p = shardtool_cli(command, str(mix))
        assert p.returncode == 1 and "a mixture file is read by" in p.stderr and "pack FILE" not in p.stderr


@pytest.mark.timeout(120)
def test_loader_without_cache_gives_the_same_clear_errors(tmp_path):
    from shardtool.format.errors import FormatError as FE
    from shardtool.loader import ShardedLoader

    jsonl = write_jsonl(str(tmp_path / "data.jsonl"), token_records(3))
    with pytest.raises(FE, match="unknown protocol 'fiel://'.*holding index.json"):
        ShardedLoader("fiel:///data/ds", batch_size=2, rank=0, world_size=1)
    with pytest.raises(FE, match="is a file, not a dataset.*holding index.json"):
        ShardedLoader(jsonl, batch_size=2, rank=0, world_size=1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["tar", "arrow"])
def test_verify_names_the_damaged_sample(tmp_path, fmt):
    out = str(tmp_path / "o")
    shardtool.pack(
        write_jsonl(str(tmp_path / "in.jsonl"), token_records(40)),
        out,
        format=fmt,
        samples_per_shard=10,
        length="tokens",
    )
    ds = shardtool.open_dataset(out)
    shard = ds.manifest.shards[2]
    idx = ds.shard_index(2)
    k = 6
    flip_byte(os.path.join(out, shard.path), int(idx.offsets[k]) + int(idx.sizes[k]) // 2, 0x04)
    rep = verify(out)
    (bad,) = rep["bad"]
    assert bad["shard"] == shard.path
    if fmt == "tar":  # one sample's byte range holds the flipped byte
        assert bad["samples"] == [{"index": k, "key": idx.keys[k]}]
        assert f"damaged sample #{k} ({idx.keys[k]!r})" in bad["error"]
    else:  # an Arrow sample's range is its record batch: every row of that batch is named
        rows = [i for i in range(len(idx)) if idx.batch[i] == idx.batch[k]]
        assert [s["index"] for s in bad["samples"]] == rows and k in rows
        assert f"#{rows[0]}..#{rows[-1]} ({idx.keys[rows[0]]!r}..{idx.keys[rows[-1]]!r})" in bad["error"]
    p = shardtool_cli("verify", out)
    assert p.returncode == 1 and shard.path in p.stderr and bad["error"] in p.stderr


def _bad_late_jsonl(tmp_path, n=40, bad_at=35):
    lines = [json.dumps(r) for r in token_records(n)]
    lines[bad_at] = '{"tokens": [1, 2'
    return write_jsonl(str(tmp_path / "in.jsonl"), [], raw_lines=lines)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [1, 2])
def test_failed_pack_removes_what_it_created(tmp_path, workers):
    src = _bad_late_jsonl(tmp_path)  # shards are published before the bad line is reached
    out = tmp_path / "fresh" / "ds"
    with pytest.raises(BadSampleError, match=r"line 36\): malformed JSON"):
        shardtool.pack(src, str(out), samples_per_shard=5, workers=workers)
    assert not os.path.exists(out) and os.path.isdir(tmp_path / "fresh")  # only what it made is gone
    p = shardtool_cli("pack", src, "-o", str(out), "--samples-per-shard", "5", "-q")
    assert p.returncode == 1 and "malformed JSON" in p.stderr and not os.path.exists(out)


@pytest.mark.timeout(120)
def test_failed_pack_keeps_what_was_there_before(tmp_path):
    out = tmp_path / "ds"
    good = write_jsonl(str(tmp_path / "good.jsonl"), token_records(12))
    shardtool.pack(good, str(out), samples_per_shard=5)  # t0000-w00-00000{0,1,2}.*
    with open(out / "shards" / "notes.txt", "w") as f:
        f.write("mine")
    kept = dir_digest(str(out))
    with pytest.raises(BadSampleError):
        shardtool.pack(_bad_late_jsonl(tmp_path), str(out), samples_per_shard=5, overwrite=True)
    # --overwrite writes the new dataset beside the old one, which stays published as it was
    # until the new one is whole (it was unpublished first, and lost with the failed pack).
    assert dir_digest(str(out)) == kept and not os.path.exists(out / ".shardtool-overwrite")
    # A pack refused because OUT already holds a dataset changes nothing in it.
    shardtool.pack(good, str(out), samples_per_shard=5, overwrite=True)
    assert os.path.exists(out / "shards" / "notes.txt") and not os.path.exists(out / ".shardtool-overwrite")
    digest = dir_digest(str(out))
    with pytest.raises(ShardtoolError, match="already holds a dataset"):
        shardtool.pack(_bad_late_jsonl(tmp_path), str(out), samples_per_shard=5)
    assert dir_digest(str(out)) == digest


def test_a_source_of_one_piece_of_work_says_the_other_workers_idle(tmp_path):
    """pyarrow writes a file of under a million rows as one row group, one worker's work: the
    README's ``--workers 8`` on it packed with one worker and said nothing."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from helpers.realtext import byte_ids, stdlib_files

    table = pa.table({"tokens": [byte_ids(p).tolist() for p in stdlib_files(60)]})
    pq.write_table(table, str(tmp_path / "one.parquet"))
    got = shardtool.pack(str(tmp_path / "one.parquet"), str(tmp_path / "a"), length="tokens", workers=2)
    assert any("1 piece(s) of work for 2 workers" in w and "row_group_size" in w for w in got.warnings)
    pq.write_table(table, str(tmp_path / "groups.parquet"), row_group_size=20)
    split = shardtool.pack(str(tmp_path / "groups.parquet"), str(tmp_path / "b"), length="tokens", workers=2)
    assert split.warnings == [] and split.samples == got.samples == 60
    assert {s.path.split("-")[1] for s in shardtool.open_dataset(str(tmp_path / "b")).manifest.shards} == {"w00", "w01"}
