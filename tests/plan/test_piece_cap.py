"""Documents of a few tokens fill a packed row's pieces (``max_docs_per_row``, 64 at rows of
1,024) long before its tokens: captions of icons by class name (3-66 tokens, median 6) packed
at 1,024 filled rows to 0.635, and neither `shardtool plan` nor the loader said why. Both now
say so and name the option; the option is in `plan` too. Real data: the names of the stdlib's
functions as byte ids (most under 20 bytes)."""

from __future__ import annotations

import json
import logging
import re

import numpy as np
import pytest

import shardtool
from helpers.realtext import stdlib_files
from helpers.runcli import shardtool_cli
from shardtool.loader import ShardedLoader


@pytest.fixture(scope="module")
def names(tmp_path_factory) -> str:
    found: list[bytes] = []
    for p in stdlib_files(200):
        found += re.findall(rb"^\s*def (\w+)", open(p, "rb").read(), flags=re.M)
    rows = [{"tokens": np.frombuffer(n, np.uint8).astype(np.uint16)} for n in found[:6000]]
    root = str(tmp_path_factory.mktemp("cap") / "ds")
    shardtool.pack(rows, root, length="tokens")
    return root


@pytest.mark.timeout(120)
def test_plan_says_the_piece_cap_closes_the_rows_and_takes_the_option(names):
    size = ["--seq-len", "1024", "--batch-size", "4", "--json"]
    capped = json.loads(shardtool_cli("plan", names, *size).stdout)
    assert capped["max_docs_per_row"] == 64 and capped["fill_rate"] < 0.8
    assert "max_docs_per_row=64" in capped["piece_cap"] and "--max-docs-per-row" in capped["piece_cap"]
    wider = json.loads(shardtool_cli("plan", names, *size, "--max-docs-per-row", "256").stdout)
    assert wider["max_docs_per_row"] == 256 and wider["fill_rate"] > 0.95 and "piece_cap" not in wider
    assert wider["batches_per_rank"] < capped["batches_per_rank"]
    text = shardtool_cli("plan", names, *size[:-1]).stdout
    assert "NOTE" in text and "max_docs_per_row=64" in text


@pytest.mark.timeout(120)
def test_the_loader_warns_once_and_not_when_the_cap_is_raised(names, caplog):
    kw = dict(seq_len=1024, batch_size=4, rank=0, world_size=1, num_workers=0, metrics=False)
    with caplog.at_level(logging.WARNING, logger="shardtool"):
        ld = ShardedLoader(names, **kw)
        assert len(ld) > 0
        ld.set_epoch(1)
        assert len(ld) > 0
    said = [r.getMessage() for r in caplog.records if "max_docs_per_row" in r.getMessage()]
    assert len(said) == 1 and names in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shardtool"):
        assert len(ShardedLoader(names, max_docs_per_row=256, **kw)) > 0
    assert not [r for r in caplog.records if "max_docs_per_row" in r.getMessage()]
