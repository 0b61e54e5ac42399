"""Fixtures shared by every test module: real LocalClusters for the session.

`local_cluster` (2 workers, 1 ps) serves most modules; `two_workers_two_ps`,
`one_worker_two_ps`, `three_workers_one_ps` and `two_workers_three_ps` serve the
modules that need those shapes (a TF task takes seconds to start: one cluster per
shape, not one per module). Each of these four is closed after the last module
that uses it (in collection order), and started again if a later module of that
shape runs in the same process (pytest-xdist's scheduling).

Tests that kill, stop, throttle or restart tasks of a shared cluster must leave
every task running at full speed when they finish (restart/resume, or the
`restore_shared_clusters` fixture), or start their own LocalCluster instead.
"""

import os
import sys
import warnings

import pytest

# Lets a bare `pytest` (not only `python -m pytest`) import psclient from this checkout.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from psclient._cluster.local import LocalCluster  # noqa: E402


# The shared clusters besides `local_cluster`, by fixture name: (workers, ps).
_SHAPES = {"two_workers_two_ps": (2, 2), "one_worker_two_ps": (1, 2), "three_workers_one_ps": (3, 1),
           "two_workers_three_ps": (2, 3)}
_open_clusters: dict[str, LocalCluster] = {}  # the open shared clusters, local_cluster too
_last_modules: dict[str, object] = {}  # fixture name -> path of the last module that uses it


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject.toml's addopts): two test processes at most. Half the suite's time
    is waits (hang timeouts, recoveries, task start-up) with a core idle, so two processes
    took it from 18 to 10.8 minutes on the project's 2 cores (docs/development.md); each runs
    its own shared clusters (3 to 4 task processes each), so more would trade memory and load
    for little."""
    return max(1, min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def local_cluster():
    """A LocalCluster with 2 workers and 1 ps, shared by the whole session."""
    with LocalCluster(num_workers=2, num_ps=1) as cluster:
        _open_clusters["local_cluster"] = cluster
        yield cluster
        _open_clusters.pop("local_cluster", None)


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


def _shared(name):
    """The open cluster of shape `name`, started now if there is none: the first module of that
    shape, or a module that runs after the one that closed it (`pytest_runtest_teardown`). With
    `pytest-xdist` a process runs a share of the modules, in an order of the scheduler's: a
    cluster closed after its last module in collection order may be needed again there."""
    cluster = _open_clusters.get(name)
    if cluster is None:
        num_workers, num_ps = _SHAPES[name]
        # Generous: 3 or 4 TF tasks start at once, and restarts wait as long, on a loaded machine.
        cluster = _open_clusters[name] = LocalCluster(num_workers=num_workers, num_ps=num_ps, start_timeout=300)
    return cluster


@pytest.fixture(scope="session", autouse=True)
def _close_shared_clusters():
    """At the end of the session: the shared clusters still open are closed."""
    yield
    for name in [name for name in _open_clusters if name in _SHAPES]:
        _open_clusters.pop(name).close()


@pytest.fixture(scope="module")
def two_workers_two_ps():
    """A LocalCluster with 2 workers and 2 ps, shared by the modules of that shape."""
    return _shared("two_workers_two_ps")


@pytest.fixture(scope="module")
def one_worker_two_ps():
    """A LocalCluster with 1 worker and 2 ps, shared by the modules of that shape."""
    return _shared("one_worker_two_ps")


@pytest.fixture(scope="module")
def three_workers_one_ps():
    """A LocalCluster with 3 workers and 1 ps, shared by the modules of that shape."""
    return _shared("three_workers_one_ps")


@pytest.fixture(scope="module")
def two_workers_three_ps():
    """A LocalCluster with 2 workers and 3 ps, shared by the modules of that shape (their
    strategies may use only the first ps tasks)."""
    return _shared("two_workers_three_ps")


@pytest.fixture
def restore_shared_clusters():
    """After the test: every task of the shared clusters runs again at full speed (restarts
    the ones it killed, resumes the ones it stopped, ends their throttles), even when it failed
    before its own clean-up."""
    yield
    for cluster in list(_open_clusters.values()):
        throttled = cluster.throttled()
        for job, index, _ in cluster.cluster.tasks():
            if not cluster.is_running(job, index):
                cluster.restart(job, index)
                continue
            cluster.resume(job, index)  # SIGCONT: nothing to a task that was not stopped
            if (job, index) in throttled:
                cluster.throttle(job, index, 1.0)


@pytest.fixture(autouse=True, scope="module")
def _shared_tasks_running():
    """Before each module: a task of a shared cluster that exited on its own during an earlier
    module is started again, and its end is reported as a warning with the last lines of its log.

    A test that kills a shared task restarts it (`restore_shared_clusters`), so a task found gone
    here ended by itself: a crash of TF's runtime that the earlier module's tests did not see (one
    suite run found a worker gone by SIGSEGV this way). The module after it, which did not cause
    it, then starts on a whole cluster instead of failing for it; the warning keeps the crash in
    the run's summary."""
    for name, cluster in list(_open_clusters.items()):
        for job, index, _ in cluster.cluster.tasks():
            if cluster.is_running(job, index):
                continue
            tail = cluster.logs(job, index)[-3000:]
            warnings.warn(f"Shared cluster {name}: task {job}:{index} had ended before this module "
                          f"({cluster!r}); restarting it. Last lines of its log:\n{tail}",
                          RuntimeWarning, stacklevel=1)
            cluster.restart(job, index)
    yield


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    """Notes the last module (in run order, after deselection) using each shared shape."""
    _last_modules.clear()
    for item in items:
        for name in _SHAPES:
            if name in getattr(item, "fixturenames", ()):
                _last_modules[name] = item.path


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Closes a shared cluster after the last module that uses it, once that
    module's own fixtures (its strategies) are torn down."""
    yield
    if nextitem is not None and nextitem.path == item.path:
        return
    for name, path in list(_last_modules.items()):
        if path == item.path and name in _open_clusters:
            _open_clusters.pop(name).close()  # a later module of its shape starts another (`_shared`)
