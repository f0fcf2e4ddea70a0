"""An exception raised by user code (transform, collate_fn) reaches the training loop as itself.

Only the loader's own failures — a worker killed, exited or timed out — are a LoaderError; a
user's RuntimeError (or EOFError, ConnectionError, …) keeps its type and message, with notes
saying which batch, shard and sample it was raised on, for any num_workers.
"""

from __future__ import annotations

import pytest

from shardtool.loader import LoaderError, ShardedLoader
from test_loader_data import write_dataset

BAD = "s000021"  # shard-00001.tar sample #1


class TwoFields(Exception):
    """An exception whose constructor takes two arguments (cannot be rebuilt from one string)."""

    def __init__(self, code, detail):
        super().__init__(code, detail)
        self.code, self.detail = code, detail


class Unrebuildable(Exception):
    """Its args do not say how to construct it again: neither unpickling nor type(text) works."""

    def __init__(self, what, why):
        super().__init__()
        self.what, self.why = what, why

    def __str__(self):
        return f"unrebuildable: {self.what}"


def _raiser(exc):
    def transform(sample):
        if sample["__key__"] == BAD:
            raise exc
        return sample

    return transform


def _text(e: BaseException) -> str:
    return "\n".join([str(e), *getattr(e, "__notes__", [])])


def _run(root, workers, **kw):
    for _ in ShardedLoader(root, batch_size=4, num_workers=workers, **kw):
        pass


def _bad_batch(root) -> str:
    """'batch b' for the batch that holds BAD (global id 21) in the plan of rank 0."""
    plan = ShardedLoader(root, batch_size=4, num_workers=0).plan
    return f"batch {next(b for b, ids in enumerate(plan.batches()) if 21 in ids.tolist())} "


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return write_dataset(str(tmp_path_factory.mktemp("d")), [20, 20])[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize(
    "exc",
    [RuntimeError("CUDA error: my transform's bug"), EOFError("my EOF"), ConnectionResetError(104, "my peer reset")],
    ids=lambda e: type(e).__name__,
)
def test_a_transform_error_is_raised_as_itself_with_where(root, workers, exc):
    with pytest.raises(type(exc)) as info:
        _run(root, workers, transform=_raiser(exc))
    e = info.value
    assert type(e) is type(exc) and not isinstance(e, LoaderError), repr(e)
    assert e.args == exc.args
    text = _text(e)
    assert _bad_batch(root) in text and BAD in text and "shard-00001.tar" in text, text
    assert "killed" not in text and "worker process failed" not in text, text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 2])
def test_a_collate_fn_runtime_error_is_raised_as_itself(root, workers):
    def collate(samples):
        if any(s["__key__"] == BAD for s in samples):
            raise RuntimeError("shape mismatch in my collate")
        return samples

    with pytest.raises(RuntimeError, match="shape mismatch in my collate") as info:
        _run(root, workers, collate_fn=collate)
    assert not isinstance(info.value, LoaderError)
    assert _bad_batch(root) in _text(info.value) and "shard-00001.tar" in _text(info.value)


@pytest.mark.timeout(60)
def test_exceptions_with_structured_arguments_cross_from_a_worker_intact(root):
    with pytest.raises(TwoFields) as info:
        _run(root, 2, transform=_raiser(TwoFields(7, "detail")))
    assert (info.value.code, info.value.detail) == (7, "detail")
    text = _text(info.value)
    assert "in loader worker" in text and "transform" in text and BAD in text, text


@pytest.mark.timeout(60)
def test_an_exception_that_cannot_cross_is_named_not_mistaken_for_a_dead_worker(root):
    with pytest.raises(Exception) as info:
        _run(root, 2, transform=_raiser(Unrebuildable("x", "y")))
    assert not isinstance(info.value, LoaderError)
    text = _text(info.value)
    assert "Unrebuildable" in text and "unrebuildable: x" in text and BAD in text, text
