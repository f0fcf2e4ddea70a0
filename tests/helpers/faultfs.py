"""A wrapping fsspec filesystem that injects faults at the storage edge, for tests and benchmarks.

    fsspec.core.url_to_fs("faulty:///abs/path", latency=0.01, transient={"000003.tar": 2})

wraps the local filesystem (or ``target_protocol``/``target_options``) and, per request (an
open, a cat, each read call of an open file — like one ranged GET each):

- ``latency``: seconds slept per request;
- ``bandwidth``: bytes per second the source serves, over every reader of one ``bandwidth_file``
  (a pipe shared across processes, as a storage server's link is), else per instance;
- ``transient``: {substring: k} — the first k requests on a matching path raise ConnectionResetError;
- ``missing``: [substring, ...] — matching paths raise FileNotFoundError (a 404);
- ``stall``: {substring: [seconds, k]} — the first k reads on a matching path sleep ``seconds`` first;
- ``short``: {substring: k} — the first k opens of a matching path end early (half the file);
- ``refuse``: True — every request raises ConnectionRefusedError (the source is down);
- ``hang``: [substring, ...] — requests on matching paths never return (a server that accepted
  the connection and went silent); only a signal whose handler raises ends the wait.

Fault counters live on the instance (``cachable = False``), so each ``url_to_fs`` starts fresh;
``fs.requests`` counts requests per path for assertions ("one try, no retry storm").
"""

from __future__ import annotations

import collections
import fcntl
import os
import struct
import threading
import time

import fsspec
from fsspec.spec import AbstractFileSystem


class FaultyFileSystem(AbstractFileSystem):
    protocol = ("faulty",)
    cachable = False

    def __init__(
        self,
        target_protocol: str = "file",
        target_options: dict | None = None,
        *,
        latency: float = 0.0,
        transient: dict | None = None,
        missing=(),
        stall: dict | None = None,
        short: dict | None = None,
        refuse: bool = False,
        hang=(),
        bandwidth: float = 0.0,
        bandwidth_file: str | None = None,
        **kw,
    ):
        super().__init__(**kw)
        self.fs = fsspec.filesystem(target_protocol, **(target_options or {}))
        self.latency = latency
        self.transient = dict(transient or {})
        self.missing = list(missing)
        self.stall = {k: tuple(v) for k, v in (stall or {}).items()}
        self.short = dict(short or {})
        self.refuse = refuse
        self.hang = list(hang)
        self.bandwidth, self.bandwidth_file = bandwidth, bandwidth_file
        self._free_at = 0.0
        self.requests: collections.Counter = collections.Counter()
        self._used: collections.Counter = collections.Counter()
        self._lock = threading.Lock()

    def _take(self, table: dict, path: str, limit_of=lambda v: v) -> object | None:
        """The matching entry of ``table`` if its budget for ``path`` is not used up yet."""
        for pat, v in table.items():
            if pat in path:
                with self._lock:
                    key = (id(table), pat)
                    if self._used[key] < limit_of(v):
                        self._used[key] += 1
                        return v
        return None

    def _request(self, path: str) -> None:
        with self._lock:
            self.requests[path] += 1
        if self.latency:
            time.sleep(self.latency)
        if self.refuse:
            raise ConnectionRefusedError(f"faultfs: connection refused for {path}")
        while any(h in path for h in self.hang):
            time.sleep(3600)
        if any(m in path for m in self.missing):
            raise FileNotFoundError(f"faultfs: {path} not found (404)")
        if self._take(self.transient, path) is not None:
            raise ConnectionResetError(f"faultfs: transient error on {path}")

    def _pace(self, n: int) -> None:
        """Hold the caller until the shared pipe has carried its ``n`` bytes after everyone else's."""
        if not self.bandwidth or not n:
            return
        if self.bandwidth_file is None:
            with self._lock:
                now = time.time()
                self._free_at = max(self._free_at, now) + n / self.bandwidth
                wait = self._free_at - now
        else:
            fd = os.open(self.bandwidth_file, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                raw = os.pread(fd, 8, 0)
                now = time.time()
                free_at = max(struct.unpack("<d", raw)[0] if len(raw) == 8 else 0.0, now) + n / self.bandwidth
                os.pwrite(fd, struct.pack("<d", free_at), 0)
            finally:
                os.close(fd)
            wait = free_at - now
        if wait > 0:
            time.sleep(wait)

    # ---------------------------------------------------------------- fsspec API
    def info(self, path, **kw):
        self._request(path)
        return self.fs.info(path, **kw)

    def ls(self, path, detail=True, **kw):
        self._request(path)
        return self.fs.ls(path, detail=detail, **kw)

    def cat_file(self, path, start=None, end=None, **kw):
        path = self._strip_protocol(path)
        self._request(path)
        data = self.fs.cat_file(path, start=start, end=end, **kw)
        self._pace(len(data))
        return data

    def _open(self, path, mode="rb", block_size=None, autocommit=True, cache_options=None, **kw):
        if "r" not in mode:
            raise NotImplementedError("faultfs is read-only")
        self._request(path)
        f = self.fs.open(path, "rb")
        limit = None
        if self._take(self.short, path) is not None:
            limit = self.fs.size(path) // 2
        return _FaultyFile(self, f, path, limit)


class FileWrapper:
    """A read-only file object wrapping ``self.f``: what fsspec and our readers need besides read()."""

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self.f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _FaultyFile(FileWrapper):
    def __init__(self, owner: FaultyFileSystem, f, path: str, limit: int | None):
        self.owner, self.f, self.path, self.limit = owner, f, path, limit
        self.pos = 0

    def read(self, n: int = -1) -> bytes:
        self.owner._request(self.path)
        st = self.owner._take(self.owner.stall, self.path, limit_of=lambda v: v[1])
        if st is not None:
            time.sleep(st[0])
        if self.limit is not None:
            left = self.limit - self.pos
            n = left if n is None or n < 0 else min(n, left)
            if n <= 0:
                return b""
        data = self.f.read(n)
        self.owner._pace(len(data))
        self.pos += len(data)
        return data


fsspec.register_implementation("faulty", FaultyFileSystem, clobber=True)
