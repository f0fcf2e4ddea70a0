"""Names and paths that comments, docstrings and docs point to exist: a reference to a module
that moved or a function that was renamed sends the next reader looking for nothing."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OURS = ("shardtool", "loader", "cache", "benchmarks", "tests", "examples")
FILES = sorted(
    [p for d in OURS for p in (REPO / d).rglob("*.py")]
    + [p for p in REPO.glob("*.md")]
    + [p for p in (REPO / "docs").rglob("*.md")]
)
FILES = [p for p in FILES if p != Path(__file__).resolve()]  # this file names stale ones on purpose
# Names of other projects' code that our text names in backticks (peers, torch, Lightning).
THEIRS = {
    "BaseDataLoader", "BinPackCollator", "CheckpointManager", "DataLoader", "DataLoaderShard",
    "DistributedSampler", "ImageFolder", "IterableDataset", "KeyboardInterrupt", "LongTensor",
    "MemoryError", "ParallelAwareDataloader", "RecordBatchReader", "RerunDataIterator",
    "ShardWriter", "StatefulDataLoader", "StopIteration", "StreamingDataLoader", "StreamingDataset",
    "ToTensor", "TokensLoader", "DeviceMesh", "DoubleTensor", "LightningDataModule", "LightningModule", "ModelCheckpoint",
    "CombinedLoader", "DistributedDataParallel", "FileNotFoundError", "TypeError", "ValueError",
    "RuntimeError", "OSError", "BufferError", "IndexError", "AttributeError", "NotImplementedError", "KeyError",
    "LengthGroupedSampler", "SlowDown",
}  # fmt: skip

PATH = re.compile(
    r"(?<![\w./-])((?:shardtool|loader|cache|benchmarks|tests|examples)/(?:[\w-]+/)*[\w-]+\.(?:py|md|sh))\b"
)
DOTTED = re.compile(r"`(shardtool(?:\.\w+)+)`")
CAMEL = re.compile(r"`([A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)+)(?:\(\))?`")


def _texts():
    for p in FILES:
        yield p.relative_to(REPO), p.read_text(encoding="utf-8", errors="replace")


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _exists(path: str) -> bool:
    # Paths are written from the repository root, or (in the package) from shardtool/'s layout,
    # where loader/ and cache/ are shardtool.loader and shardtool.cache.
    return (REPO / path).exists() or (path.startswith("shardtool/") and (REPO / path.split("/", 1)[1]).exists())


def test_paths_named_in_the_code_and_docs_exist():
    missing = [(str(f), p) for f, text in _texts() for p in PATH.findall(text) if not _exists(p)]
    assert missing == []


def test_dotted_names_in_backticks_resolve():
    missing = [(str(f), d) for f, text in _texts() for d in DOTTED.findall(text) if not _resolves(d)]
    assert missing == []


def test_class_names_in_backticks_are_ours_or_named_as_others():
    ours: set[str] = set()
    for p in FILES:
        if p.suffix == ".py":
            text = p.read_text(encoding="utf-8")
            ours |= set(re.findall(r"^\s*class (\w+)", text, re.M)) | set(re.findall(r"^(\w+)\s*[:=]", text, re.M))
    unknown = sorted({(str(f), n) for f, text in _texts() for n in CAMEL.findall(text) if n not in ours | THEIRS})
    assert unknown == []


@pytest.mark.parametrize("stale", ["`MixedLoader`", "(loader/probe.py)", "`shardtool.plan.rank.next_segment_batches`"])
def test_the_checks_catch_the_kinds_of_reference_that_went_stale(stale):
    # The three the project once had (issue 32): each is caught by one of the checks above.
    caught = (
        any(n not in THEIRS for n in CAMEL.findall(stale))
        or any(not _exists(p) for p in PATH.findall(stale))
        or any(not _resolves(d) for d in DOTTED.findall(stale))
    )
    assert caught
