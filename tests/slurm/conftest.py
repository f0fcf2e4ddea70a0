"""Fixtures for tests that need a real (local, single-machine) SLURM cluster.

    def test_x(slurm_cluster):                       # session-wide 2-node cluster, default logging prolog
        slurm_cluster.srun("-N2", "hostname")

    def test_y(slurm_cluster_with_prolog, tmp_path):  # same cluster restarted with my prolog for this test;
        c = slurm_cluster_with_prolog(my_prolog)       # the default prolog is restored afterwards

Tests using either fixture are marked `slurm` (select/deselect with -m). Where a cluster cannot run here
(not root, not Linux, no slurm-wlm and no apt-get) they are skipped with the reason; under SHARDTOOL_TEST_STRICT=1
(CI) that skip is a failure (tests/helpers/skips.py).
"""

from __future__ import annotations

import pytest

from helpers.skips import require

from .harness import LocalSlurm, available

SLURM_FIXTURES = ("slurm_cluster", "slurm_cluster_with_prolog")


def _require_slurm() -> None:
    ok, why = available()
    require(ok, f"local SLURM cluster unavailable: {why}")


def pytest_collection_modifyitems(config, items):
    # only items that request our fixtures; everything else is left untouched
    for item in items:
        if any(f in getattr(item, "fixturenames", ()) for f in SLURM_FIXTURES):
            item.add_marker(pytest.mark.slurm)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A 2-node LocalSlurm (node1, node2), up for the whole session, torn down at the end even on failure."""
    _require_slurm()
    LocalSlurm.reap_orphans()
    cluster = LocalSlurm()
    try:
        cluster.up(2)
        yield cluster
    finally:
        cluster.down()


@pytest.fixture
def slurm_cluster_with_prolog(slurm_cluster):
    """Factory: `c = slurm_cluster_with_prolog(path)` restarts the session cluster with that prolog (an
    executable; runs as root with no PATH, finds config via `. "${SLURM_CONF%/*}/cluster.env"`) and returns it.
    At teardown the cluster is restarted with the default prolog, so drained nodes and custom prologs never
    leak into other tests."""
    used = []

    def restart_with(prolog) -> LocalSlurm:
        used.append(prolog)
        return slurm_cluster.restart(prolog=prolog)

    yield restart_with
    if used:
        slurm_cluster.restart(prolog=None)
