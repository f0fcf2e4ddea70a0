"""--length-fn from the current directory, and --max-length with drop / truncate."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import shardtool
from helpers.data_gen import read_all, token_records, write_jsonl, write_parquet
from helpers.runcli import REPO, shardtool_cli
from shardtool.format.errors import ShardtoolError
from shardtool.pack.merge import merge
from shardtool.pack.verify import verify

# How the installed ``shardtool`` command starts: a script outside the working directory, so
# sys.path[0] is the script's directory, not the current one (python -m and -c would add it).
LAUNCHER = "import sys\nfrom shardtool.cli import main\nsys.exit(main())\n"
API_SCRIPT = """import sys
import shardtool
r = shardtool.pack(sys.argv[1], sys.argv[2], length_fn="mylen:triple", workers=2, samples_per_shard=4)
print(r.samples)
"""
MYLEN = "def triple(sample):\n    return 3 * len(sample['tokens'])\n"


@pytest.mark.timeout(120)
def test_length_fn_module_in_the_current_directory(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "mylen.py").write_text(MYLEN)
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "shardtool_cmd.py").write_text(LAUNCHER)
    (tools / "pack_api.py").write_text(API_SCRIPT)
    recs = token_records(20)
    src = write_jsonl(str(tmp_path / "in.jsonl"), recs)
    env = dict(os.environ, PYTHONPATH=REPO)  # this checkout, but not the working directory
    p = subprocess.run(
        [
            sys.executable,
            str(tools / "shardtool_cmd.py"),
            "pack",
            src,
            "-o",
            str(tmp_path / "cli"),
            "--length-fn",
            "mylen:triple",
            "--workers",
            "2",
            "--samples-per-shard",
            "4",
            "-q",
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert p.returncode == 0, p.stderr
    p = subprocess.run(
        [sys.executable, str(tools / "pack_api.py"), src, str(tmp_path / "api")],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert p.returncode == 0 and p.stdout.strip() == "20", p.stderr
    want = [3 * len(r["tokens"]) for r in recs]
    for out in ("cli", "api"):
        assert shardtool.open_dataset(str(tmp_path / out)).lengths.tolist() == want
    # A module that is nowhere: the error says where it looked.
    p = subprocess.run(
        [
            sys.executable,
            str(tools / "shardtool_cmd.py"),
            "pack",
            src,
            "-o",
            str(tmp_path / "x"),
            "--length-fn",
            "nosuchmod:f",
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert p.returncode == 1 and "cannot import 'nosuchmod'" in p.stderr and str(work) in p.stderr


def _records(n=60, seed=3):
    return token_records(n, seed=seed, max_len=40)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["tar", "arrow"])
@pytest.mark.parametrize("source", ["jsonl", "parquet"])  # parquet into tar takes the columnar fast path
def test_max_length_truncate_cuts_the_length_field(tmp_path, fmt, source):
    recs = _records()
    src = (
        write_jsonl(str(tmp_path / "in.jsonl"), recs)
        if source == "jsonl"
        else write_parquet(str(tmp_path / "in.parquet"), recs, row_group_size=16, token_dtype=np.int64)
    )
    out = str(tmp_path / "o")
    cap = 12
    r = shardtool.pack(
        src, out, format=fmt, length="tokens", max_length=cap, max_length_policy="truncate", samples_per_shard=16
    )
    over = sum(len(x["tokens"]) > cap for x in recs)
    assert 0 < over < len(recs)
    assert r.samples == len(recs) and r.truncated == over and r.dropped == 0
    assert f"truncated {over} over --max-length" in r.summary()
    got = list(shardtool.open_dataset(out))
    assert [list(s["tokens"]) for s in got] == [x["tokens"][:cap] for x in recs]
    assert [s["text"] for s in got] == [x["text"] for x in recs]  # other fields untouched
    assert shardtool.open_dataset(out).lengths.tolist() == [min(len(x["tokens"]), cap) for x in recs]
    assert verify(out)["ok"]  # the index records the lengths of what is stored


@pytest.mark.timeout(120)
def test_max_length_drop_skips_and_counts(tmp_path):
    recs = _records()
    src = write_jsonl(str(tmp_path / "in.jsonl"), recs)
    cap = 12
    keep = [i for i, x in enumerate(recs) if len(x["tokens"]) <= cap]
    r = shardtool.pack(src, str(tmp_path / "o"), length="tokens", max_length=cap, workers=2, samples_per_shard=8)
    assert r.samples == len(keep) and r.dropped == len(recs) - len(keep) and r.truncated == 0 and r.skipped == []
    got = read_all(str(tmp_path / "o"))
    assert sorted(got) == [f"{i:09d}" for i in keep]  # the kept samples keep their positions as keys
    # drop works with any length definition, e.g. the default payload bytes
    shardtool.pack(src, str(tmp_path / "all"))
    sizes = shardtool.open_dataset(str(tmp_path / "all")).lengths
    median = int(np.median(sizes))
    rb = shardtool.pack(src, str(tmp_path / "b"), max_length=median)
    assert rb.dropped == int((sizes > median).sum()) > 0
    assert shardtool.open_dataset(str(tmp_path / "b")).lengths.tolist() == [int(x) for x in sizes if x <= median]
    # job array: every task counts its own, merge adds them up
    for t in range(2):
        shardtool.pack(src, str(tmp_path / "arr"), length="tokens", max_length=cap, num_tasks=2, task_index=t)
    m = merge(str(tmp_path / "arr"))
    assert m["samples"] == len(keep) and m["dropped"] == len(recs) - len(keep)
    p = shardtool_cli("pack", src, "-o", str(tmp_path / "cli"), "--length", "tokens", "--max-length", str(cap), "-q")
    assert p.returncode == 0 and f"dropped {len(recs) - len(keep)} and truncated 0 over --max-length" in p.stdout
    p = shardtool_cli(
        "pack",
        src,
        "-o",
        str(tmp_path / "cli2"),
        "--length",
        "tokens",
        "--max-length",
        str(cap),
        "--max-length-policy",
        "truncate",
        "--json",
    )
    assert p.returncode == 0 and json.loads(p.stdout)["truncated"] == len(recs) - len(keep)


@pytest.mark.timeout(60)
def test_truncate_needs_an_array_length_field(tmp_path):
    src = write_jsonl(str(tmp_path / "in.jsonl"), _records(5))
    for kw, what in [
        ({"length": "text"}, "--length 'text' is stored as text"),
        ({}, "the length is not a field"),
        ({"length_fn": "helpers.tests_length_fn:double_tokens"}, "the length is not a field"),
    ]:
        with pytest.raises(ShardtoolError, match="truncate .* needs --length naming a 1-D array field; " + what):
            shardtool.pack(src, str(tmp_path / "o"), max_length=3, max_length_policy="truncate", **kw)
    assert not os.path.exists(tmp_path / "o")
    with pytest.raises(ShardtoolError, match="--max-length must be an integer ≥ 1"):
        shardtool.pack(src, str(tmp_path / "o"), max_length=0)
    with pytest.raises(ShardtoolError, match="--max-length-policy must be one of drop, truncate"):
        shardtool.pack(src, str(tmp_path / "o"), max_length=3, max_length_policy="cut")
    with pytest.raises(ShardtoolError, match=r"no samples were packed \(5 dropped by --max-length\)"):
        shardtool.pack(src, str(tmp_path / "o"), length="tokens", max_length=1)
    assert not os.path.exists(tmp_path / "o")
