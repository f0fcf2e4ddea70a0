"""Where a dataset's bytes come from: positioned reads of local files and ranged requests to
remote stores (through fsspec), and opening a dataset URL with errors that say what was given."""

from __future__ import annotations

import errno
import json
import os
import posixpath
from typing import Any

from .errors import FormatError
from .manifest import MANIFEST_NAME
from .nodeshare import shared_read

__all__ = [
    "LocalRange",
    "RemoteRange",
    "cat_whole",
    "dataset_fs",
    "is_local",
    "not_a_dataset",
    "open_range",
    "past_end",
    "read_file",
    "read_manifest",
    "shard_location",
]


def is_local(fs) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,))


def share_key(fs, path: str, start: int | None = None, end: int | None = None) -> str:
    """What a read is, for `nodeshare.shared_read`: the filesystem and its options, path, range."""
    # The session is how a process makes its clients (an object per process), not what is read.
    given = {k: v for k, v in getattr(fs, "storage_options", {}).items() if k != "session"}
    options = json.dumps(given, sort_keys=True, default=str)
    return f"{fs.protocol}|{options}|{path}|{start}|{end}"


def past_end(e: OSError) -> bool:
    """Whether ``e`` is an HTTP 416: a range wholly past the object's end (s3fs says EINVAL,
    without the object's name)."""
    return e.errno == errno.EINVAL or "not satisfiable" in str(e)


def cat_whole(fs, path: str) -> bytes:
    """A whole file. Remote, one GET of "bytes=0-": asked for no range, s3fs first asks the
    object's size (a HEAD) to split a large read."""
    if is_local(fs):
        return fs.cat_file(path)
    try:
        return fs.cat_file(path, start=0)
    except OSError as e:
        if not past_end(e):
            raise
        return fs.cat_file(path)  # an empty object has no byte 0 to start at


def cat_shared(fs, path: str, start: int | None = None, end: int | None = None) -> bytes:
    """``fs.cat_file(path, start, end)``, fetched once per node for a job's ranks (`nodeshare`)."""

    def read() -> bytes:
        if start is not None or end is not None:
            return fs.cat_file(path, start=start, end=end)
        return cat_whole(fs, path)

    return shared_read(share_key(fs, path, start, end), read, local=is_local(fs))


class LocalRange:
    """Positioned reads on one local file descriptor (thread-safe, no seek state)."""

    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)

    def read(self, offset: int, size: int) -> bytes:
        data = os.pread(self.fd, size, offset)
        if len(data) != size:
            raise FormatError(
                f"{self.path}: short read at offset {offset} ({len(data)} of {size} bytes); shard truncated?"
            )
        return data

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class RemoteRange:
    """One ranged request per read; no read-ahead, which would waste bandwidth on random access."""

    def __init__(self, fs, path: str):
        self.fs = fs
        self.path = path

    def read(self, offset: int, size: int) -> bytes:
        try:
            data = self.fs.cat_file(self.path, start=offset, end=offset + size)
        except FileNotFoundError:
            raise FormatError(f"{self.path}: shard not found (404)") from None
        except OSError as e:
            if past_end(e):  # the object is shorter than its index says
                raise FormatError(
                    f"{self.path}: range {offset}..{offset + size} is past the end of the object "
                    f"({e}); shard truncated?"
                ) from None
            raise
        if len(data) != size:
            raise FormatError(
                f"{self.path}: short read at offset {offset} ({len(data)} of {size} bytes); shard truncated?"
            )
        return data

    def close(self) -> None:
        pass


def open_range(fs, path: str):
    return LocalRange(path) if is_local(fs) else RemoteRange(fs, path)


DATASET_URL_HELP = (
    "a dataset URL names a directory or object-store prefix holding index.json, as written by "
    "`shardtool pack` (e.g. /data/ds, file:///data/ds, s3://bucket/ds)"
)


def dataset_fs(url: str, storage_options: dict | None = None):
    """(filesystem, root path) of a dataset URL; an unknown protocol is a FormatError that says
    what a dataset URL looks like (fsspec's own error names neither)."""
    import fsspec  # lazily: it costs ~0.1-0.3 s of start-up, which pack never needs

    protocol = _protocol(url)
    if protocol is not None:
        try:
            fsspec.get_filesystem_class(protocol)  # known or registered at run time; ImportError if not installed
        except ValueError:
            raise FormatError(f"{url!r}: unknown protocol {protocol + '://'!r}; {DATASET_URL_HELP}") from None
    return store_fs(url, storage_options)


def store_fs(url: str, storage_options: dict | None = None):
    """(filesystem, root path) of ``url`` with the store's defaults (`store_defaults`); an unknown
    protocol is fsspec's own ValueError (`dataset_fs` says what a dataset URL looks like instead)."""
    import fsspec

    return fsspec.core.url_to_fs(url, **store_defaults(_protocol(url), storage_options or {}))


def _protocol(url: str) -> str | None:
    import fsspec

    return fsspec.core.split_protocol(url)[0] if "::" not in url else None


# A loader process fetches up to 16 ranges at once (loader/batchcache.py FETCH_THREADS) and reads
# a dataset's sample indexes in parallel; botocore's default pool of 10 connections queued them.
S3_POOL_CONNECTIONS = 32


def store_defaults(protocol: str | None, options: dict) -> dict:
    """``options`` with our defaults for the store added where the user set none: on S3, a pool
    of `S3_POOL_CONNECTIONS` connections (``config_kwargs={"max_pool_connections": ...}``), and
    clients made from the process's one session (`s3_session`) unless a session or profile is given."""
    if protocol not in ("s3", "s3a"):
        return options
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("max_pool_connections", S3_POOL_CONNECTIONS)
    out = {**options, "config_kwargs": config}
    if "session" not in options and "profile" not in options:
        out["session"] = s3_session()
    return out


_session: Any = None


def s3_session():
    """The aiobotocore session this process makes its S3 clients from, made once.

    A session keeps the service models it parsed. A loader's workers are forked after the rank's
    process read the manifest through it, so each makes its client from parsed models: 36 ms to
    a first byte against 186 ms for a session of its own (measured on moto, 2 cores), which every
    worker paid at once at the start of a pass without a node cache. It pickles as a call to this
    function, so a filesystem sent to another process uses that process's own session."""
    global _session
    if _session is None:
        from aiobotocore.session import AioSession

        class SharedSession(AioSession):
            def __reduce__(self):
                return s3_session, ()

        _session = SharedSession()
    return _session


def read_manifest(fs, root: str, url: str) -> bytes:
    """The bytes of ``index.json`` under ``root``; if there is none, a FormatError saying what
    ``url`` is instead (a file such as a JSONL source, a directory without a dataset, nothing)."""
    path = posixpath.join(root, MANIFEST_NAME) if root else MANIFEST_NAME
    try:
        return cat_shared(fs, path)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        pass
    raise FormatError(f"{url!r} {not_a_dataset(fs, root)}; {DATASET_URL_HELP}")


def not_a_dataset(fs, root: str) -> str:
    """What ``root`` is, where it holds no manifest: a file, a directory without one, nothing."""
    try:
        is_file, exists = fs.isfile(root), fs.exists(root)
    except OSError:
        is_file, exists = False, True
    if is_file and root.endswith((".json", ".yaml", ".yml")):  # a mixture file's names
        what = (
            "is a file, not a dataset: a mixture file is read by the loader, plan, trace and warm; "
            "this reads one dataset (give one of its sources' URLs)"
        )
    elif is_file:
        what = "is a file, not a dataset (to pack it: shardtool pack FILE -o DIR)"
    elif exists:
        what = f"holds no {MANIFEST_NAME}, so it is not a dataset (or its pack has not finished)"
    else:
        what = "does not exist"
    return what


def read_file(fs, path: str, *, what: str) -> bytes:
    try:
        return cat_shared(fs, path)
    except FileNotFoundError:
        raise FormatError(f"{what}: {path} not found") from None


def shard_location(fs, root: str, info) -> tuple:
    """(filesystem, path) of shard ``info``'s bytes: ``root/info.path`` for a shard the dataset
    holds; for one indexed in place, its ``source`` — a URL on its own filesystem, or a path
    relative to the dataset root on the dataset's."""
    source = info.source
    if source is None:
        return fs, posixpath.join(root, info.path) if root else info.path
    if "://" in source:
        return dataset_fs(source)
    return fs, posixpath.normpath(posixpath.join(root, source) if root else source)
