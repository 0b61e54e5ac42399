"""Fixtures shared by every test module: one real LocalCluster for the session.

Tests that kill, stop or restart tasks of the shared `local_cluster` must leave
every task running when they finish (restart/resume), or start their own
LocalCluster instead.
"""

import os
import sys

import pytest

# Lets a bare `pytest` (not only `python -m pytest`) import psclient from this checkout.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from psclient._cluster.local import LocalCluster  # noqa: E402


@pytest.fixture(scope="session")
def local_cluster():
    """A LocalCluster with 2 workers and 1 ps, shared by the whole session."""
    with LocalCluster(num_workers=2, num_ps=1) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def strategy(local_cluster):
    """A ParameterServerStrategy on the shared cluster, one per test module.

    TensorFlow keeps one cluster connection per process, so each module's
    strategy is shut down before the next module connects its own.
    """
    from psclient._coordinator.strategy import ParameterServerStrategy

    s = ParameterServerStrategy(local_cluster.cluster)
    yield s
    s.shutdown()
