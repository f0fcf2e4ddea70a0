"""A real HTTP reverse proxy in front of the moto S3 server (tests/helpers/s3server.py): it counts the
requests s3fs sends and, when asked, answers some of them as an overloaded object store would.

    with S3Proxy(s3_server.endpoint) as proxy:  # or the ``s3_proxy`` fixture
        fs = s3fs.S3FileSystem(**proxy.storage_options)
        ...
        c = proxy.counts()  # c.by_kind["RANGED_GET"], c.by_key["bucket/ds/shards/000001.tar"], ...

Every request is forwarded unchanged (method, path, query, headers and body; only the hop-by-hop
framing headers are the proxy's own), so the SigV4 signature s3fs made still matches. Counts
(:class:`Counts`, thread-safe, :meth:`S3Proxy.reset`) are by method, by kind (``GET``,
``RANGED_GET``, ``HEAD``, ``LIST``: a GET on a bucket with list parameters, ``PUT``, ``POST``,
``DELETE``, ``OTHER``), by object key and kind, with the body bytes served per key and the answers'
status codes. Faults (:class:`Faults`, replaceable at any time with :meth:`S3Proxy.set_faults`):

- ``slowdown_rate``/``slowdown_burst``: a token bucket of N requests/s; a request that finds no
  token is answered ``503`` with S3's SlowDown XML error body, as S3 does above a prefix's
  request rate (a refused request takes no token);
- ``slowdown_first``: the first k matching requests answered so, whatever the rate (deterministic);
- ``reset_first``/``reset_every``: the first k requests / every k-th request gets a TCP reset (RST) instead of an answer;
- ``reset_body_every``: every k-th GET with a body gets its headers and half its body, then a reset;
- ``latency``: seconds added before each answer (a slow store);
- ``match``: which requests the faults apply to (all by default), e.g. only one object's GETs.

It runs in-process, one thread per client connection (keep-alive kept, as S3 does), and stops
cleanly: :meth:`S3Proxy.stop` ends the accept loop, shuts every open connection and joins every
thread it started.
"""

from __future__ import annotations

import collections
import copy
import http.client
import os
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

KINDS = ("GET", "RANGED_GET", "HEAD", "LIST", "PUT", "POST", "DELETE", "OTHER")
# Parameters of ListObjects(V2) (and ListObjectVersions/Uploads are subresources: OTHER)
LIST_PARAMS = frozenset(
    {"list-type", "prefix", "delimiter", "marker", "continuation-token", "max-keys", "start-after", "encoding-type"}
)
# Hop-by-hop: the framing of one connection, which a proxy makes its own (RFC 9110 7.6.1); Expect
# too, because the proxy already answered the client's 100-continue.
HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "expect",
    }
)

SLOWDOWN_XML = (
    '<?xml version="1.0" encoding="UTF-8"?>\n'
    "<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message>"
    "<Resource>{resource}</Resource><RequestId>{rid}</RequestId><HostId>s3proxy</HostId></Error>"
)


@dataclass(frozen=True)
class Request:
    """One request as the store sees it: ``key`` is "bucket/key" ("bucket" on a bucket)."""

    method: str
    kind: str
    bucket: str
    key: str
    range: str | None


def classify(method: str, target: str, headers) -> Request:
    parts = urlsplit(target)
    path = unquote(parts.path).lstrip("/")
    bucket, _, obj = path.partition("/")
    query = parse_qs(parts.query, keep_blank_values=True)
    rng = headers.get("Range")
    if method == "GET":
        if not bucket:
            kind = "OTHER"  # ListBuckets
        elif not obj:
            kind = "LIST" if not query or LIST_PARAMS.intersection(query) else "OTHER"
        else:
            kind = "RANGED_GET" if rng else "GET"
    elif method in ("HEAD", "PUT", "POST", "DELETE"):
        kind = method
    else:
        kind = "OTHER"
    return Request(method, kind, bucket, f"{bucket}/{obj}" if obj else bucket, rng)


class TokenBucket:
    """``rate`` tokens a second, at most ``burst`` held (full at the start)."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic):
        if not rate > 0 or burst < 1:
            raise ValueError(f"need rate > 0 and burst >= 1, found {rate!r}, {burst!r}")
        self.rate, self.burst, self.clock = float(rate), float(burst), clock
        self.tokens, self.last = float(burst), clock()
        self.lock = threading.Lock()

    def take(self) -> bool:
        with self.lock:
            now = self.clock()
            self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
            self.last = now
            if self.tokens >= 1:
                self.tokens -= 1
                return True
            return False


@dataclass(frozen=True)
class Faults:
    slowdown_rate: float | None = None  # requests/s let through; the rest answered 503 SlowDown
    slowdown_burst: int = 5
    slowdown_first: int = 0  # the first k matching requests answered 503 SlowDown (deterministic)
    reset_first: int = 0  # the first k matching requests: a TCP reset (deterministic)
    reset_every: int = 0  # every k-th matching request: a TCP reset instead of an answer
    reset_body_every: int = 0  # every k-th matching GET with a body: half the body, then a reset
    latency: float = 0.0  # seconds slept before each matching answer
    bandwidth: float | None = None  # bytes/s an answer's body is sent at (a store's per-request rate)
    match: Callable[[Request], bool] | None = None  # which requests the faults apply to (None: all)


@dataclass
class Counts:
    """A snapshot of what the proxy saw since its start or last :meth:`S3Proxy.reset`."""

    total: int = 0
    by_method: collections.Counter = field(default_factory=collections.Counter)
    by_kind: collections.Counter = field(default_factory=collections.Counter)
    by_key: collections.Counter = field(default_factory=collections.Counter)  # every request on a key
    by_key_kind: collections.Counter = field(default_factory=collections.Counter)  # (key, kind)
    bytes_by_key: collections.Counter = field(default_factory=collections.Counter)  # body bytes sent whole
    status: collections.Counter = field(default_factory=collections.Counter)  # answers sent, by code
    throttled: int = 0  # answered 503 SlowDown by the proxy
    throttled_by_key: collections.Counter = field(default_factory=collections.Counter)
    resets: int = 0  # connections reset (before an answer or mid-body)
    forwarded: int = 0  # requests moto answered

    def copy(self) -> Counts:
        return copy.deepcopy(self)

    def kinds(self) -> dict[str, int]:
        """Requests by kind, every kind listed (0 where none)."""
        return {k: self.by_kind.get(k, 0) for k in KINDS}

    def keys_of(self, kind: str) -> collections.Counter:
        """{key: requests of ``kind`` on it}."""
        return collections.Counter({k: n for (k, kd), n in self.by_key_kind.items() if kd == kind})

    def summary(self) -> str:
        kinds = " ".join(f"{k}={n}" for k, n in self.kinds().items() if n)
        codes = " ".join(f"{c}:{n}" for c, n in sorted(self.status.items()))
        return (
            f"{self.total} requests ({kinds}); answers {codes}; throttled {self.throttled}, "
            f"resets {self.resets}, forwarded {self.forwarded}"
        )


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # socketserver's default backlog is 5: a loader opening 30 connections at once overflowed it,
    # and the connections the kernel dropped were retried a second later (a stall no store has).
    request_queue_size = 1024
    block_on_close = False  # threads are joined by S3Proxy.stop, after their sockets are shut

    def __init__(self, proxy: S3Proxy):
        self.proxy = proxy
        self.conns: set[socket.socket] = set()
        self.threads: set[threading.Thread] = set()
        self.track_lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Handler)

    def process_request(self, request, client_address):
        t = threading.Thread(
            target=self.process_request_thread, args=(request, client_address), name="s3proxy-conn", daemon=True
        )
        with self.track_lock:
            self.conns.add(request)
            self.threads.add(t)
        t.start()

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.track_lock:
                self.conns.discard(request)
                self.threads.discard(threading.current_thread())

    def handle_error(self, request, client_address):  # a client that went away mid-answer: not news
        pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as S3 and s3fs use it
    timeout = 60  # an idle keep-alive connection is closed after this
    server: _Server

    def setup(self):
        super().setup()
        self.upstream: http.client.HTTPConnection | None = None

    def finish(self):
        try:
            super().finish()
        except OSError:
            pass
        if self.upstream is not None:
            self.upstream.close()

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass

    # ------------------------------------------------------------------ one request
    def _any(self):
        proxy = self.server.proxy
        body = self._read_body()
        req = classify(self.command, self.path, self.headers)
        action, latency = proxy.admit(req)
        if latency:
            time.sleep(latency)  # the fault itself: a slow store, not synchronisation
        if action == "reset":
            proxy.on_reset()
            self._reset()
            return
        if action == "slowdown":
            data = b"" if self.command == "HEAD" else self._slowdown_body(req)
            self._answer(503, "Slow Down", [("Content-Type", "application/xml")], data, len(data))
            proxy.on_answer(req, 503, 0)
            return
        try:
            status, reason, headers, data = self._forward(body)
        except (OSError, http.client.HTTPException) as e:
            msg = f"s3proxy: upstream failed: {type(e).__name__}: {e}".encode()
            self._answer(502, "Bad Gateway", [("Content-Type", "text/plain")], msg, len(msg))
            proxy.on_answer(req, 502, 0)
            return
        proxy.on_forwarded()
        rate = proxy.faults.bandwidth
        if rate and data and (proxy.faults.match is None or proxy.faults.match(req)):
            time.sleep(len(data) / rate)  # the body's transfer at the store's rate, as one send
        if action == "reset_body" and len(data) > 1:
            proxy.on_answer(req, status, 0)
            proxy.on_reset()
            self._answer(status, reason, headers, data[: len(data) // 2], len(data), reset=True)
            return
        self._answer(status, reason, headers, data, None)
        proxy.on_answer(req, status, 0 if self.command == "HEAD" else len(data))

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = do_OPTIONS = do_PATCH = _any

    def _read_body(self) -> bytes | None:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else None

    def _forward(self, body: bytes | None):
        proxy = self.server.proxy
        for attempt in (0, 1):
            conn = self.upstream or http.client.HTTPConnection(proxy.upstream_host, proxy.upstream_port, timeout=120)
            self.upstream = None
            try:
                conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for k, v in self.headers.items():
                    if k.lower() not in HOP and k.lower() != "content-length":
                        conn.putheader(k, v)
                if body is not None or self.command in ("PUT", "POST"):
                    conn.putheader("Content-Length", str(len(body or b"")))
                conn.endheaders(body)
                resp = conn.getresponse()
                data = b"" if self.command == "HEAD" else resp.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                conn.close()  # moto closed a kept-alive connection before this request: once more, fresh
                if attempt:
                    raise
                continue
            except BaseException:
                conn.close()
                raise
            if resp.will_close:
                conn.close()
            else:
                self.upstream = conn
            return resp.status, resp.reason, resp.getheaders(), data
        raise AssertionError("unreachable")

    def _answer(self, status, reason, headers, data: bytes, length: int | None, reset: bool = False):
        self.send_response_only(status, reason)
        for k, v in headers:
            kl = k.lower()
            if kl in HOP or (kl == "content-length" and self.command != "HEAD"):
                continue
            self.send_header(k, v)
        if self.command != "HEAD":
            self.send_header("Content-Length", str(len(data) if length is None else length))
        self.end_headers()
        if data:
            self.wfile.write(data)
        self.wfile.flush()
        if reset:
            self._reset()

    def _reset(self):
        """A TCP reset: close with SO_LINGER 0, so the kernel sends RST, not FIN."""
        self.close_connection = True
        try:
            self.wfile.flush()
        except OSError:
            pass
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.connection.close()

    def _slowdown_body(self, req: Request) -> bytes:
        return SLOWDOWN_XML.format(resource="/" + req.key, rid=uuid.uuid4().hex[:16].upper()).encode()


class S3Proxy:
    """A counting, fault-injecting reverse proxy to ``upstream`` (``http://host:port``)."""

    def __init__(self, upstream: str, faults: Faults | None = None, *, storage_options: dict | None = None):
        u = urlsplit(upstream)
        self.upstream_host, self.upstream_port = u.hostname, u.port or 80
        self._base_options = storage_options
        self._lock = threading.Lock()
        self._counts = Counts()
        self._seen_for_faults = 0
        self._gets_for_faults = 0
        self.set_faults(faults or Faults())
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ life cycle
    def start(self) -> S3Proxy:
        self._server = _Server(self)
        self.port = self._server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="s3proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """End the accept loop, shut every open client connection, join every thread; raises if
        one is still alive after ``timeout`` seconds."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()  # returns once serve_forever has returned
        self._thread.join(timeout)
        with server.track_lock:
            conns, threads = list(server.conns), list(server.threads)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)  # wakes a handler blocked reading the next request
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(deadline - time.monotonic(), 0))
        server.server_close()
        alive = [t for t in threads if t.is_alive()] + ([self._thread] if self._thread.is_alive() else [])
        if alive:
            raise RuntimeError(f"s3proxy: {len(alive)} thread(s) still running {timeout}s after stop")

    def threads_alive(self) -> int:
        server = self._server
        if server is None:
            return 0
        with server.track_lock:
            return sum(t.is_alive() for t in server.threads)

    def __enter__(self) -> S3Proxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def storage_options(self) -> dict:
        """s3fs options that go through this proxy (the credentials of tests/helpers/s3server.py)."""
        from helpers.s3server import CREDS

        base = dict(self._base_options or {**CREDS, "skip_instance_cache": True})
        base["client_kwargs"] = {**base.get("client_kwargs", {}), "endpoint_url": self.endpoint}
        base["client_kwargs"].setdefault("region_name", "us-east-1")
        return base

    # ------------------------------------------------------------------ counts and faults
    def counts(self) -> Counts:
        with self._lock:
            return self._counts.copy()

    def reset(self) -> Counts:
        """Start counting afresh (and refill the token bucket); returns the counts until now."""
        with self._lock:
            old, self._counts = self._counts, Counts()
            self._seen_for_faults = self._gets_for_faults = 0
            f = self.faults
            self._bucket = None if f.slowdown_rate is None else TokenBucket(f.slowdown_rate, f.slowdown_burst)
        return old

    def set_faults(self, faults: Faults) -> None:
        with self._lock:
            self.faults = faults
            self._bucket = (
                None if faults.slowdown_rate is None else TokenBucket(faults.slowdown_rate, faults.slowdown_burst)
            )
            self._seen_for_faults = self._gets_for_faults = 0

    def admit(self, req: Request) -> tuple[str, float]:
        """Count ``req`` and decide its fate: ("forward" | "slowdown" | "reset" | "reset_body", latency)."""
        with self._lock:
            c = self._counts
            c.total += 1
            c.by_method[req.method] += 1
            c.by_kind[req.kind] += 1
            c.by_key[req.key] += 1
            c.by_key_kind[(req.key, req.kind)] += 1
            f, bucket = self.faults, self._bucket
            if f.match is not None and not f.match(req):
                return "forward", 0.0
            self._seen_for_faults += 1
            n = self._seen_for_faults
            if req.kind in ("GET", "RANGED_GET"):
                self._gets_for_faults += 1
            g = self._gets_for_faults
        if n <= f.slowdown_first or (bucket is not None and not bucket.take()):
            with self._lock:
                self._counts.throttled += 1
                self._counts.throttled_by_key[req.key] += 1
            return "slowdown", f.latency
        if n <= f.reset_first or (f.reset_every and n % f.reset_every == 0):
            return "reset", f.latency
        if f.reset_body_every and req.kind in ("GET", "RANGED_GET") and g % f.reset_body_every == 0:
            return "reset_body", f.latency
        return "forward", f.latency

    def on_answer(self, req: Request, status: int, nbytes: int) -> None:
        with self._lock:
            self._counts.status[status] += 1
            if nbytes:
                self._counts.bytes_by_key[req.key] += nbytes

    def on_reset(self) -> None:
        with self._lock:
            self._counts.resets += 1

    def on_forwarded(self) -> None:
        with self._lock:
            self._counts.forwarded += 1


def stdlib_dataset(root: str, files: int = 200, shard_size: int = 1_000_000, fitting: bool = False) -> str:
    """Real text to serve: the first ``files`` stdlib source files as byte-id token rows, packed
    as plain Arrow shards of about ``shard_size`` bytes (200 files: 13 shards, 10 MB). With
    ``fitting``, only files whose row fits a shard (many small shards: many requests)."""
    import shardtool
    from helpers.realtext import byte_ids, stdlib_files

    paths = stdlib_files(files * 4 if fitting else files)
    if fitting:  # a row is 4 bytes a byte (int32 ids) and its path
        paths = [p for p in paths if 4 * os.path.getsize(p) + 4096 < shard_size][:files]
    rows = [{"tokens": byte_ids(p), "path": os.path.relpath(p)} for p in paths]
    shardtool.pack(rows, root, format="arrow", length="tokens", shard_size=shard_size)
    return root


@pytest.fixture
def s3_proxy(s3_server):
    """A fresh proxy (no faults, counts at 0) in front of the session's moto server."""
    with S3Proxy(s3_server.endpoint) as proxy:
        yield proxy


__all__ = ["KINDS", "Counts", "Faults", "Request", "S3Proxy", "TokenBucket", "classify", "s3_proxy", "stdlib_dataset"]
