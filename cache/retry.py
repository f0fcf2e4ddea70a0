"""Retrying transient source errors: exponential backoff with full jitter, per-attempt timeouts,
an overall deadline. Only the transient I/O errors declared below are retried; anything else is
raised at once: a 404, a refusal or a storage client's other errors as a permanent RemoteError
naming the object, our own errors and Python's (a TypeError is a bug, not an outage) as they are,
and what is not an ``Exception`` (an interrupt) untouched.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ..format.errors import ShardtoolError
from .errors import RemoteError, SourceMissing, SourceRefused, SourceUnavailable

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 5  # tries per object, the first included
    base_delay: float = 0.5  # seconds before the 2nd try; doubles each time
    max_delay: float = 20.0  # cap on one backoff sleep
    attempt_timeout: float | None = 900.0  # one whole try of one object
    stall_timeout: float | None = 60.0  # one read call returning nothing for this long


def backoff_delay(policy: RetryPolicy, failures: int, rng: random.Random) -> float:
    """Full jitter: uniform in [0, min(max_delay, base * 2**(failures-1))], so many nodes that
    failed together do not retry together."""
    cap = min(policy.max_delay, policy.base_delay * (2 ** max(failures - 1, 0)))
    return rng.uniform(0, cap)


# An OSError is an I/O failure worth another try (sockets, timeouts incl. fsspec's FSTimeoutError,
# requests/urllib3 errors that botocore wraps, aiohttp's ClientOSError, our ShortRead and
# HashMismatch) unless it is one of these, which another try cannot fix.
PERMANENT_OS_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)

# Network errors of the storage clients fsspec uses that are not OSErrors, matched by
# (top-level package, class name) anywhere in the error's class hierarchy, so that none of these
# packages has to be installed, let alone imported.
TRANSIENT_CLIENT_ERRORS = frozenset(
    {
        ("botocore", "ConnectionError"),  # EndpointConnectionError, ConnectTimeoutError, ProxyConnectionError
        ("botocore", "HTTPClientError"),  # ReadTimeoutError, ConnectionClosedError, ResponseStreamingError
        ("botocore", "IncompleteReadError"),
        ("aiohttp", "ClientConnectionError"),  # ServerDisconnectedError, ServerTimeoutError, ClientOSError
        ("aiohttp", "ClientPayloadError"),  # the body ended early
        ("urllib3", "ProtocolError"),  # connection aborted mid-response
        ("http", "IncompleteRead"),
        ("asyncio", "TimeoutError"),  # not an OSError before Python 3.11
        ("concurrent", "TimeoutError"),
    }
)


def is_transient(exc: BaseException) -> bool:
    """Whether another try may succeed: a declared transient I/O error, or our own transient RemoteError."""
    if isinstance(exc, RemoteError):
        return not exc.permanent
    if isinstance(exc, OSError):
        return not isinstance(exc, PERMANENT_OS_ERRORS)
    return any((k.__module__.partition(".")[0], k.__name__) in TRANSIENT_CLIENT_ERRORS for k in type(exc).__mro__)


def raised_as_is(exc: BaseException) -> bool:
    """Errors not retried that keep their own type: ours, and Python's own other than OSError
    (TypeError, NameError, KeyError...: a bug, which must not read as an outage of the source)."""
    return isinstance(exc, ShardtoolError) or (type(exc).__module__ == "builtins" and not isinstance(exc, OSError))


def call_with_timeout(fn: Callable[[], T], timeout: float | None) -> T:
    """Run ``fn`` but give up after ``timeout`` seconds (TimeoutError). A stalled call is left
    behind on a daemon thread: Python cannot interrupt a blocked socket read, only abandon it."""
    if timeout is None:
        return fn()
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the caller below
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(max(timeout, 0.0))
    if t.is_alive():
        raise TimeoutError(f"no answer from the source within {timeout:.1f}s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def with_retries(
    fn: Callable[[float | None], T],
    *,
    what: str,
    policy: RetryPolicy,
    deadline: float | None = None,
    rng: random.Random | None = None,
    on_retry: Callable[[int, BaseException, float], None] | None = None,
) -> T:
    """Call ``fn(attempt_timeout)`` until it succeeds, a permanent error, the retry budget or
    the deadline (``time.monotonic()`` value). Raises SourceMissing / SourceUnavailable naming ``what``."""
    failures = 0
    while True:
        timeout = policy.attempt_timeout
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SourceUnavailable(f"{what}: deadline reached after {failures} failed attempt(s)")
            timeout = left if timeout is None else min(timeout, left)
        try:
            return fn(timeout)
        except MemoryError:
            raise
        except (FileNotFoundError, NotADirectoryError):  # a path through a file: no such object either
            raise SourceMissing(f"{what}: not found in the source (404); not retried") from None
        except Exception as e:  # not BaseException: an interrupt (Ctrl-C, SystemExit, the loader's
            # stall watchdog's StallInterrupt, a cancellation) must reach its handler as itself,
            # never read as a refusal of the source
            if not is_transient(e):
                if raised_as_is(e):
                    raise
                raise SourceRefused(f"{what}: {type(e).__name__}: {e}; not retried") from e
            failures += 1
            if failures >= policy.attempts:
                raise SourceUnavailable(
                    f"{what}: {failures} attempts failed; last error: {type(e).__name__}: {e}"
                ) from e
            rng = rng or random.Random()  # seeded from os.urandom: only when a retry needs it
            delay = backoff_delay(policy, failures, rng)
            if deadline is not None:
                delay = min(delay, max(deadline - time.monotonic(), 0))
            if on_retry is not None:
                on_retry(failures, e, delay)
            time.sleep(delay)
