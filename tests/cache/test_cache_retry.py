"""Which errors the cache retries: transient I/O errors only. A bug in our code (a TypeError, a
NameError) must surface at once as itself, not after five tries as "source unavailable"."""

from __future__ import annotations

import aiohttp
import botocore.exceptions
import fsspec.exceptions
import pytest

from helpers import faultfs  # noqa: F401  registers faulty://
from helpers.cachedata import make_dataset
from shardtool.cache import RetryPolicy
from shardtool.cache.errors import LocalFault, SourceCorrupt, SourceMissing, SourceRefused, SourceUnavailable
from shardtool.cache.retry import is_transient, with_retries
from shardtool.cache.store import Origin
from shardtool.format.manifest import MANIFEST_NAME

FAST = RetryPolicy(attempts=5, base_delay=0.001, max_delay=0.002, attempt_timeout=10, stall_timeout=10)


def counting(exc: BaseException):
    calls = []

    def fn(timeout):
        calls.append(timeout)
        raise exc

    return fn, calls


@pytest.mark.parametrize(
    "exc",
    [
        TypeError("unsupported operand"),
        NameError("name 'x' is not defined"),
        AttributeError("no attribute"),
        KeyError("k"),
        ValueError("bad value"),
    ],
)
def test_a_programming_error_is_raised_as_itself_after_one_call(exc):
    fn, calls = counting(exc)
    with pytest.raises(type(exc)) as ei:
        with_retries(fn, what="index.json", policy=FAST)
    assert ei.value is exc and len(calls) == 1


TRANSIENT = [
    ConnectionResetError("reset by peer"),
    ConnectionRefusedError("refused"),
    TimeoutError("no answer"),
    OSError(5, "Input/output error"),
    fsspec.exceptions.FSTimeoutError(),
    botocore.exceptions.EndpointConnectionError(endpoint_url="http://127.0.0.1:1"),
    botocore.exceptions.ReadTimeoutError(endpoint_url="http://127.0.0.1:1"),
    botocore.exceptions.ConnectionClosedError(endpoint_url="http://127.0.0.1:1"),
    botocore.exceptions.ResponseStreamingError(error="stream cut"),
    aiohttp.ServerDisconnectedError(),
    aiohttp.ClientPayloadError("payload cut"),
]


@pytest.mark.parametrize("exc", TRANSIENT, ids=lambda e: type(e).__name__)
def test_transient_io_errors_are_retried_up_to_the_budget(exc):
    assert is_transient(exc)
    fn, calls = counting(exc)
    with pytest.raises(SourceUnavailable, match="5 attempts"):
        with_retries(fn, what="shard 3", policy=FAST)
    assert len(calls) == 5


@pytest.mark.parametrize(
    "exc, raised",
    [
        (FileNotFoundError("gone"), SourceMissing),
        (PermissionError("denied"), SourceRefused),
        (IsADirectoryError("dir"), SourceRefused),
        (LocalFault("disk full"), LocalFault),
        (SourceCorrupt("hash"), SourceCorrupt),
        # a storage client's own permanent error: not retried, but still a failure of the source
        (botocore.exceptions.NoCredentialsError(), SourceRefused),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else type(v).__name__,
)
def test_permanent_errors_are_not_retried(exc, raised):
    assert not is_transient(exc)
    fn, calls = counting(exc)
    with pytest.raises(raised):
        with_retries(fn, what="shard 3", policy=FAST)
    assert len(calls) == 1


def test_through_a_real_filesystem_a_bug_is_one_request_and_a_reset_is_retried(tmp_path):
    src = make_dataset(str(tmp_path / "ds"), shards=1, samples=2)
    # a bad option type makes every request raise TypeError inside the storage layer
    bad = Origin("faulty://" + src, {"latency": "10ms"})
    with pytest.raises(TypeError):
        bad.read_bytes(MANIFEST_NAME, policy=FAST)
    assert sum(bad.fs.requests.values()) == 1

    flaky = Origin("faulty://" + src, {"transient": {MANIFEST_NAME: 2}})  # two connection resets, then fine
    assert flaky.read_bytes(MANIFEST_NAME, policy=FAST).startswith(b"{")
    assert flaky.fs.requests[flaky.path(MANIFEST_NAME)] == 3
