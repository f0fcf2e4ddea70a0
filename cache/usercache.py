"""A cache this process may only read, and the user's own cache that takes its misses.

The node's cache is warmed by root in the prolog; the job runs as its user, who can read it but
not write it. Reading needs no write access (:mod:`cache.locks` takes shared locks on read-only
descriptors, nothing is recorded where it is recorded already); a shard or index the node's
cache lacks is fetched, verified as always, into the user's own cache instead:
``$SHARDTOOL_USER_CACHE``, else ``$TMPDIR/shardtool-cache-<uid>`` (``/tmp`` without TMPDIR;
SLURM sites usually point TMPDIR at node-local disk). Whoever can write a cache can plant a
trusted shard in it, so the user's cache must be a directory of this user that no one else can
write; it is created with mode 0700.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping

from .errors import LocalFault

ENV_VAR = "SHARDTOOL_USER_CACHE"


def can_write(path: str) -> bool:
    """Whether this process may create files in the directory ``path`` (False on a read-only mount)."""
    effective = os.access in os.supports_effective_ids
    return os.access(path, os.W_OK | os.X_OK, effective_ids=effective)


def user_cache_dir(env: Mapping[str, str], uid: int | None = None) -> str:
    """Where this user's own cache lives: SHARDTOOL_USER_CACHE, else TMPDIR (or /tmp)/shardtool-cache-<uid>."""
    explicit = env.get(ENV_VAR)
    if explicit:
        return os.path.abspath(explicit)
    uid = os.geteuid() if uid is None else uid
    return os.path.join(env.get("TMPDIR") or "/tmp", f"shardtool-cache-{uid}")


def own_cache_dir(path: str, *, create: bool) -> str | None:
    """``path`` if it is a directory of this user that no one else may write (created 0700 when
    ``create``); None if it does not exist and not ``create``. Raises LocalFault otherwise."""
    if create:
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
        except OSError as e:
            raise LocalFault(
                f"cannot create the user cache {path}: {e.strerror or e}; set {ENV_VAR} to a "
                "directory of your own on local disk"
            ) from None
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise LocalFault(
            f"the user cache {path} is not a directory of this user (uid {os.geteuid()}) that only it "
            f"can write (found uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}); anyone who can "
            f"write it could plant shards in it. Remove it or set {ENV_VAR} to another directory"
        )
    return path


__all__ = ["ENV_VAR", "can_write", "own_cache_dir", "user_cache_dir"]
