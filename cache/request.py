"""What a job asks a shared node cache to stage: its request, parsed (pure; no I/O).

A job names its data in its SLURM comment (``sbatch --comment``), which Slurm gives a prolog as
``SLURM_JOB_COMMENT`` (22.05; ``scontrol show job`` shows it as ``Comment=`` too). One prolog then
serves every job of a cluster; its config keeps only what is the admin's. The grammar, anywhere in
the comment (other text around it is left alone)::

    shardtool:URL                 a dataset root or a mixture file (.json/.yaml); pure data parallelism
    shardtool:{"url": URL, ...}   a JSON object: url (required) and, as ShardedLoader gets them,
                                  mesh ("pp=2,dp=2,tp=2"), dp_dim ("dp" or "rep,shard"), dp_size (int),
                                  ranks_per_node (int), nodes_per_group (int); best_effort (bool: stage what fits the node's
                                  budget and let the loader fetch the rest, instead of failing the node);
                                  max_bytes ("200G" or bytes: the job's own cap on what it holds in a
                                  node's cache, per dataset; the loader fetches the rest on demand)

A relative path is the job's: it is resolved against the job's working directory. A comment with no
``shardtool:`` asks for nothing. A malformed request is the job's mistake (:class:`RequestError`), never
the node's: the prolog reports it to the job and exits 0.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from ..format.sizes import SizeError, parse_size
from .errors import UsageError

PREFIX = "shardtool:"
_KEYS = {"url", "mesh", "dp_dim", "dp_size", "ranks_per_node", "nodes_per_group", "best_effort", "max_bytes"}
# `scontrol show job -o`: Key=Value fields separated by spaces; a value may hold spaces, so it
# runs to the next token shaped like a key (capitalised name, '=').
_NEXT_KEY = re.compile(r"\s+[A-Z][A-Za-z/:]*=")


class RequestError(UsageError):
    """The job's staging request cannot be used (the job's mistake: reported to it, no drain)."""


@dataclass(frozen=True)
class StageRequest:
    url: str
    mesh: str | None = None
    dp_dim: str = "dp"
    dp_size: int | None = None
    ranks_per_node: int | None = None
    best_effort: bool = False
    max_bytes: int | None = None
    nodes_per_group: int = 1

    @property
    def model_parallel(self) -> bool:
        return self.mesh is not None or self.dp_size is not None

    @property
    def data_layout_given(self) -> bool:
        """Whether the node's share needs the request's data layout (not one group a node)."""
        return self.model_parallel or self.nodes_per_group != 1

    def to_dict(self) -> dict:
        return {
            "url": self.url,
            "mesh": self.mesh,
            "dp_dim": self.dp_dim,
            "dp_size": self.dp_size,
            "ranks_per_node": self.ranks_per_node,
            "best_effort": self.best_effort,
            "max_bytes": self.max_bytes,
            "nodes_per_group": self.nodes_per_group,
        }


def _find(comment: str) -> int | None:
    """Where the request's body starts (after the prefix), or None; RequestError if two."""
    starts = [m.end() for m in re.finditer(r"(?:^|(?<=\s))" + re.escape(PREFIX), comment)]
    if len(starts) > 1:
        raise RequestError(
            f"the job comment holds {len(starts)} '{PREFIX}' requests; give one "
            "(a mixture file stages several datasets)"
        )
    return starts[0] if starts else None


def _resolve(url: str, workdir: str | None) -> str:
    if "://" in url or os.path.isabs(url) or workdir is None:
        return url
    return os.path.normpath(os.path.join(workdir, url))


def _positive_int(body: dict, key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RequestError(f"request key {key!r} must be an integer >= 1, found {value!r}")
    return value


def _size(value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise RequestError(
            f"request key 'max_bytes' must be a size like \"200G\" or a number of bytes, found {value!r}"
        )
    try:
        return parse_size(value, what="request key 'max_bytes'")
    except SizeError as e:
        raise RequestError(str(e)) from None


def _from_json(text: str, workdir: str | None) -> StageRequest:
    try:
        body, _ = json.JSONDecoder().raw_decode(text)
    except ValueError as e:
        raise RequestError(f"the request {PREFIX}{text.strip()[:200]} is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise RequestError(f"the request must be a JSON object, found {type(body).__name__}")
    unknown = sorted(set(body) - _KEYS)
    if unknown:
        raise RequestError(f"unknown request key(s) {', '.join(map(repr, unknown))}; known: {', '.join(sorted(_KEYS))}")
    url = body.get("url")
    if not isinstance(url, str) or not url.strip():
        raise RequestError(f'the request needs "url": a dataset or mixture file, found {url!r}')
    mesh = body.get("mesh")
    if mesh is not None and (not isinstance(mesh, str) or not mesh.strip()):
        raise RequestError(f"request key 'mesh' must be a string like \"pp=2,dp=2\", found {mesh!r}")
    dp_dim = body.get("dp_dim", "dp")
    if isinstance(dp_dim, list) and dp_dim and all(isinstance(d, str) for d in dp_dim):
        dp_dim = ",".join(dp_dim)
    if not isinstance(dp_dim, str) or not dp_dim.strip():
        raise RequestError(f"request key 'dp_dim' must be a name or list of names, found {dp_dim!r}")
    best_effort = body.get("best_effort", False)
    if not isinstance(best_effort, bool):
        raise RequestError(f"request key 'best_effort' must be true or false, found {best_effort!r}")
    dp_size = _positive_int(body, "dp_size")
    if mesh is not None and dp_size is not None:
        raise RequestError("give the request either 'mesh' or 'dp_size', not both")
    if "dp_dim" in body and mesh is None:
        raise RequestError("request key 'dp_dim' names dimensions of a 'mesh', and none is given")
    return StageRequest(
        _resolve(url.strip(), workdir),
        mesh=mesh.strip() if mesh else None,
        dp_dim=dp_dim.strip(),
        dp_size=dp_size,
        ranks_per_node=_positive_int(body, "ranks_per_node"),
        best_effort=best_effort,
        max_bytes=_size(body.get("max_bytes")),
        nodes_per_group=_positive_int(body, "nodes_per_group") or 1,
    )


def parse_request(comment: str | None, *, workdir: str | None = None) -> StageRequest | None:
    """The request in a job's comment; None when it asks for nothing. RequestError when malformed.
    ``workdir``: the job's working directory, against which a relative path is resolved."""
    if not comment:
        return None
    start = _find(comment)
    if start is None:
        return None
    body = comment[start:]
    if body.lstrip().startswith(("{", "[", '"')):  # JSON (an object is the only one accepted)
        return _from_json(body.lstrip(), workdir)
    url = body.split(None, 1)[0] if body.strip() and not body[:1].isspace() else ""
    if not url:
        raise RequestError(f"'{PREFIX}' must be followed by a dataset URL, a mixture file or a JSON object")
    return StageRequest(_resolve(url, workdir))


def comment_from_env(env) -> str | None:
    """The job's comment as slurmd gives it to a prolog (SLURM_JOB_COMMENT), if it does."""
    return env.get("SLURM_JOB_COMMENT")


def comment_from_scontrol(line: str) -> str | None:
    """The ``Comment=`` field of one ``scontrol show job -o`` line (None when unset)."""
    m = re.search(r"(?:^|\s)Comment=", line)
    if m is None:
        return None
    rest = line[m.end() :]
    nxt = _NEXT_KEY.search(rest)
    value = (rest[: nxt.start()] if nxt else rest).strip()
    return None if value in ("", "(null)") else value


__all__ = ["PREFIX", "RequestError", "StageRequest", "comment_from_env", "comment_from_scontrol", "parse_request"]
