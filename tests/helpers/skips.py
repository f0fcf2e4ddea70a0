"""The one way a test skips because of where it runs: `require(ok, why)`.

A test whose needs are declared — a test dependency in pyproject.toml, root (CI runs as root),
a kernel feature every CI machine has (a boot id, a second filesystem at /dev/shm, tmpfs mounts),
the local SLURM cluster (its packages are installed by the harness) — may skip on a developer's
machine that lacks them, saying why. Under ``SHARDTOOL_TEST_STRICT=1``, which ``.ci/run`` sets,
the same skip is a failure: CI must never pass by testing less than it claims.

A declared Python package is imported plainly, never ``pytest.importorskip``-ed: a missing one
is a broken install, an error everywhere.
"""

from __future__ import annotations

import os

import pytest

STRICT_ENV = "SHARDTOOL_TEST_STRICT"


def strict() -> bool:
    return os.environ.get(STRICT_ENV) == "1"


def require(ok: bool, why: str) -> None:
    """Go on if ``ok``; else skip the test with ``why`` (a failure under SHARDTOOL_TEST_STRICT=1)."""
    if ok:
        return
    if strict():
        pytest.fail(f"{why} ({STRICT_ENV}=1: in CI this test must run, not skip)", pytrace=False)
    pytest.skip(why)


def needs_root(why: str) -> None:
    require(os.geteuid() == 0, f"needs root: {why}")
