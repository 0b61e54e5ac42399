"""The coordinator's one connection to the cluster, shared by the process.

TensorFlow keeps a single eager context per process: connecting names every
task of the cluster (`update_server_def`), and every strategy, reconnect and
disconnect of this process goes through the lock here. Its holder is
recorded, so a connect that times out says which thread holds it and why.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
import types
import warnings
from collections.abc import Mapping

import portpicker

import tensorflow as tf

from psclient._cluster.spec import Cluster
from psclient._core.errors import TaskUnreachableError
from psclient._core.view_changes import ViewChanges, warning_times
from psclient._tf import context as _context
from psclient._tf import executors as _executors
from psclient._tf import local_tables as _local_tables

__all__ = [
    "COORDINATOR_JOB", "CONNECTION_LOCK_TIMEOUT", "TF_VERSIONS", "connect", "disconnect",
    "tensorflow_range", "view_changes",
]

log = logging.getLogger("psclient")

#: The coordinator's job in TF's view of the cluster: "localhost", the job this
#: process's devices have before it connects (and the default of TF's own
#: `connect_to_cluster`). Connecting gives the process new local devices; under
#: this name they keep the old names, so datasets, iterators and variables made
#: before the strategy still find their device (under "chief" every one of them
#: failed: "/job:localhost/... unknown device"). Named lookup tables lived in
#: the old devices' resource manager: `local_tables` carries them over. The
#: cluster description still calls the coordinator's address "chief".
COORDINATOR_JOB = "localhost"

#: The TensorFlow versions psclient is tested with (the oldest by the `oldest`
#: nox session, the newest by the suite); pyproject.toml requires the same range.
#: psclient calls TF internals (executors, update_server_def, device filters),
#: so a newer TF is allowed only once the suite has run against it.
TF_VERSIONS = ((2, 16), (2, 22))  # >=2.16, <2.22
_version_checked = False


def tensorflow_range() -> str:
    """`TF_VERSIONS` as a pip requirement's version range."""
    (lo_major, lo_minor), (hi_major, hi_minor) = TF_VERSIONS
    return f">={lo_major}.{lo_minor},<{hi_major}.{hi_minor}"


def check_tensorflow_version(version: str) -> None:
    """Warn once when TF is outside `TF_VERSIONS` (installs with --no-deps skip pip's check)."""
    global _version_checked
    if _version_checked:
        return
    _version_checked = True
    match = re.match(r"(\d+)\.(\d+)", version)
    found = (int(match.group(1)), int(match.group(2))) if match else (0, 0)
    if not TF_VERSIONS[0] <= found < TF_VERSIONS[1]:
        warnings.warn(
            f"psclient is tested with tensorflow{tensorflow_range()}; this is TensorFlow "
            f"{version}. psclient relies on parts of TF's distributed runtime that change "
            "between releases: training may fail in ways the tests would have caught.",
            RuntimeWarning,
            stacklevel=3,
        )


# TF never stops the gRPC server it starts for the coordinator, so its port
# stays taken for the life of the process. The first connection fixes this
# process's coordinator address; later connections (another cluster, or the
# same one after shutdown) reuse it and update the running server's view.
_coordinator_lock = threading.Lock()
_coordinator_address: str | None = None
#: How long a connect waits for another thread's connect to finish. TF's
#: update_server_def waits for every task it names, and a task that hangs
#: holds it (in its own thread, GIL released) until the task answers.
CONNECTION_LOCK_TIMEOUT = 60.0


#: (thread name, what it does, monotonic start) of the lock's holder, for the error.
_lock_holder: tuple | None = None

#: Changes of TF's view of the cluster begun or ended in this process (`connection_changes`).
_connection_changes = 0


def connection_changes() -> int:
    """How many times a (re)connection of this process to the cluster began or ended (two a connect).

    A coordinator access that fails with a tensor its task no longer finds while this moved
    straddled a change of TF's view (`psclient._core.ps_access`): in two seeded chaos plans a
    tensor made just before such a change was gone from its ps just after it.
    """
    return _connection_changes


@contextlib.contextmanager
def _connection_lock(what: str):
    global _lock_holder
    if not _coordinator_lock.acquire(timeout=CONNECTION_LOCK_TIMEOUT):
        holder = _lock_holder
        by = "" if holder is None else (
            f" (thread {holder[0]!r}, to {holder[1]}, for {time.monotonic() - holder[2]:.0f} s)")
        raise TimeoutError(
            f"Cannot {what}: another thread of this process{by} has been reconnecting to the "
            f"cluster for over {CONNECTION_LOCK_TIMEOUT:g} s (TensorFlow's update_server_def "
            "waits for a task that accepts connections but does not answer). Resume or kill "
            "the hung task, or restart this process."
        )
    global _connection_changes
    _lock_holder = (threading.current_thread().name, what, time.monotonic())
    _connection_changes += 1
    try:
        yield
    finally:
        _connection_changes += 1
        _lock_holder = None
        _coordinator_lock.release()


def connect(cluster: Cluster, *, streaming_enqueue: bool, workers=None, patience: float = 0.0) -> None:
    """Connect this process, as the coordinator, to the cluster's task servers.

    `workers` (indices) limits the workers in TF's view of the cluster, for
    reconnecting while some are down: TF's `update_server_def` fails for
    every task it is given that is down. Indices keep their meaning (a
    sparse job). `patience`: seconds to keep trying while a named task does
    not take the connection (one restarted moments ago: gRPC's channel to it
    reconnects on its own schedule, and until then calls fail at once);
    0 raises TF's UnavailableError at once (the recovery thread decides).
    """
    global _coordinator_address
    # Environment knobs TF reads, set in this one place:
    # - GRPC_FAIL_FAST=true: every RPC to a task that is down fails at once
    #   (TF reads it per call). Under TF's own coordinator's "use_caller",
    #   update_server_def asks each task it names for its devices waiting for
    #   it to be ready: a worker that died between a reconnect's probes and the
    #   call held the recovery thread, and the connection lock, until something
    #   listened on its port again. psclient waits for tasks itself
    #   (connect_timeout, `patience`, rejoin probes).
    # - Streaming enqueue lets several calls be in flight per worker
    #   (pipelining); at depth 1 it stays off for the process: with it on, an
    #   op sent to a task that died can wait for good. Registrations made while
    #   tracing stream anyway (`streamed_registrations`); dispatcher threads
    #   call through executors of their own (`device_scope`).
    # - TF_PS_DISABLE_ASYNC_EXECUTOR_GLOBALLY makes `context.async_wait()` a
    #   no-op (TF's own ParameterServerStrategy sets it too): it syncs every
    #   task, a hung one included, and Keras calls it at every epoch end and
    #   TF's checkpoints after every save and restore. psclient runs nothing
    #   asynchronously that it would need to wait for.
    os.environ["GRPC_FAIL_FAST"] = "true"
    _executors.set_streaming_env(bool(streaming_enqueue))
    os.environ["TF_PS_DISABLE_ASYNC_EXECUTOR_GLOBALLY"] = "True"

    check_tensorflow_version(tf.__version__)
    spec: dict = cluster.training_spec()
    wanted = (spec.pop("chief", None) or [None])[0]
    if workers is not None:
        spec["worker"] = {i: spec["worker"][i] for i in sorted(workers)}
    with _connection_lock("connect to the cluster"):
        first = _coordinator_address is None
        if first:
            _coordinator_address = wanted or f"localhost:{portpicker.pick_unused_port()}"
        elif wanted and wanted != _coordinator_address:
            log.info(
                "the coordinator of this process already listens at %s; using it instead of %s",
                _coordinator_address, wanted,
            )
        spec[COORDINATOR_JOB] = [_coordinator_address]

        filters = tf.config.experimental.ClusterDeviceFilters()
        # Workers only need the ps tasks and the coordinator, ps tasks only the
        # workers and the coordinator: smaller views, no worker waits on another.
        for i in range(cluster.num_workers) if workers is None else sorted(workers):
            filters.set_device_filters("worker", i, ["/job:ps", f"/job:{COORDINATOR_JOB}"])
        for i in range(cluster.num_ps):
            filters.set_device_filters("ps", i, ["/job:worker", f"/job:{COORDINATOR_JOB}"])
        cluster_spec = tf.train.ClusterSpec(spec)
        if first:
            # Tables made before keep their contents across the connection
            # (TF gives this process a new device under the same name).
            tables = _local_tables.export_local_tables()
            # First to this process's own server alone, then updated to the whole cluster: TF registers
            # the functions this process traced before (a model fit locally first, psclient's own
            # module-level functions) on each task an update adds, and on no task at a first
            # connection, where a call of one on a ps then failed ("'__inference_...' is neither a type
            # of a primitive operation nor a name of a function registered"). The device filters
            # count from the first connection on (TF ignores them at an update).
            tf.config.experimental_connect_to_cluster(
                tf.train.ClusterSpec({COORDINATOR_JOB: [_coordinator_address]}), job_name=COORDINATOR_JOB,
                task_index=0, protocol="grpc", cluster_device_filters=filters,
            )
            _local_tables.rebuild_tables(tables)
            _restrict_coordinator_port(cluster)
            _update_patiently(cluster, cluster_spec, filters, patience)
        else:
            _restrict_coordinator_port(cluster)  # first: a worker that joins may call back while TF updates
            _update_patiently(cluster, cluster_spec, filters, patience)
        _restrict_coordinator_port(cluster)
        # Each eager op runs as itself from now on, not wrapped in a one-op function that TF
        # registers on every task and waits for: a new kind of op (a user's between fits too)
        # waited for a hung worker for as long as it hung.
        _executors.eager_ops_as_themselves_from_now()


def _update_patiently(cluster: Cluster, cluster_spec, filters, patience: float) -> None:
    deadline = time.monotonic() + patience
    while True:
        try:
            _update_connection(cluster_spec, filters)
            return
        except tf.errors.UnavailableError as error:
            first_line = str(error).split("\n", 1)[0]
            if time.monotonic() < deadline:
                log.info("connect: a task does not take the connection yet (%s); trying again", first_line)
                time.sleep(0.2)
                continue
            if patience <= 0:
                raise  # the recovery thread's reconnect: its machine decides
            # The task is read from TF's message only to name it in ours; no
            # decision depends on the text.
            address = job = index = None
            task = _TASK_IN_ERROR.search(str(error))
            if task:
                job, index = task.group(1), int(task.group(2))
                try:
                    address = cluster.address(job, index)
                except (ValueError, IndexError):  # not a task of this cluster's description
                    address = None
            named = f"task {job}:{index} at {address}" if address else "a task"
            raise TaskUnreachableError(
                f"Cannot connect to the cluster: {named} did not take the connection within "
                f"connect_timeout={patience:g} s (TensorFlow: {first_line}). Check that its "
                "`psclient serve` runs and that nothing else listens on its port.",
                task=f"{job}:{index}" if address else None, address=address,
            ) from error


#: How TF's gRPC errors name the task they came from.
_TASK_IN_ERROR = re.compile(r"/job:(\w+)/replica:\d+/task:(\d+)")


def _restrict_coordinator_port(cluster: Cluster) -> None:
    """Close the coordinator's own server port (TF binds it on every interface)
    to all but loopback and the hosts of every cluster this process connected to.

    Raises:
        PortExposedError: someone else connected to it before it was closed.
    """
    from psclient._cluster import exposure
    from psclient._cluster.server import peer_hosts

    # TF starts the server (and binds the port) lazily, when the context is
    # first used: now, so that the port is closed before anything else runs.
    _context.ensure_initialized()
    port = int(_coordinator_address.rsplit(":", 1)[1])
    if not exposure.supported():
        log.warning("the coordinator's port %d is open to every host that reaches it: TensorFlow "
                    "binds all interfaces, and socket filters need Linux", port)
        return
    _coordinator_peers.update(exposure.resolve_peers(peer_hosts(cluster)))
    # Not locked: a later connection to another cluster widens it.
    exposure.restrict_port(port, _coordinator_peers, what="the coordinator", lock=False)


# Addresses allowed to reach the coordinator's port (see _restrict_coordinator_port).
_coordinator_peers: set = set()


def disconnect() -> None:
    """Forget the cluster: TF's view becomes the coordinator alone.

    TF has no way back to a purely local context once connected, and a view
    that names tasks which are gone makes every later `tf.function` in this
    process fail (TF registers functions on every task it knows). A view of
    only this process's own server does neither.
    """
    with _connection_lock("leave the cluster"):
        if _coordinator_address is None:
            return
        spec = tf.train.ClusterSpec({COORDINATOR_JOB: [_coordinator_address]})
        _update_connection(spec, tf.config.experimental.ClusterDeviceFilters())


#: A change of TF's view of the cluster that takes this long is logged, with the tasks it dropped.
SLOW_VIEW_CHANGE_S = 10.0
#: The tasks of TF's view after the last change ("job:index" -> address): TF's view is the process's.
_view: Mapping[str, str] = types.MappingProxyType({})
#: This process's changes of TF's view (`view_changes()`: strategy.stats()["cluster_view"], the metrics).
_view_changes = ViewChanges(slow_s=SLOW_VIEW_CHANGE_S)


def view_changes() -> dict:
    """The process's changes of TF's view of the cluster so far, and the one under way (`ViewChanges.stats`)."""
    return _view_changes.stats()


def _update_connection(cluster_spec, filters) -> None:
    """Point the running coordinator server at `cluster_spec` (TF-internal API).

    TF's update closes the old context on each task it drops and each that restarted, and waits for
    every answer without a deadline (`EagerContext::CloseRemoteContexts`): a reconnect of a seeded
    chaos plan waited there 54 s (docs/chaos.md). No step runs meanwhile and nothing here can cut it
    short, so a slow one is logged while it waits (at `warning_times`: 10, 30, 60, 120 s, ...), naming
    the tasks it waits on, and once it ends, naming what it dropped.
    """
    global _view
    view = {f"{job}:{index}": address for job, tasks in cluster_spec.as_dict().items()
            for index, address in (tasks.items() if isinstance(tasks, dict) else enumerate(tasks))}
    dropped = sorted(task for task in _view if task not in view or _view[task] != view[task])
    named = {task: address for task, address in view.items() if not task.startswith(COORDINATOR_JOB + ":")}
    began = _view_changes.began(named)
    done = threading.Event()
    watch = threading.Thread(target=_warn_while_waiting, args=(done, began, named, dropped),
                             name="psclient-view-change-watch", daemon=True)
    watch.start()
    try:
        _context.update_server_def(cluster_spec, filters, COORDINATOR_JOB)
    finally:
        done.set()
        watch.join()  # it only waits on `done` and logs
        took = _view_changes.ended()
        _view = types.MappingProxyType(view)
        if took >= SLOW_VIEW_CHANGE_S:
            log.warning("TF's update of its view of the cluster took %.1f s (it waits, without a deadline, for "
                        "each task it drops or that restarted to close its old context); dropped: %s",
                        took, ", ".join(dropped) or "none")


def _warn_while_waiting(done: threading.Event, began: float, named: Mapping[str, str], dropped: list) -> None:
    """Until `done`: log at each of `warning_times` into the change that TF's update still waits."""
    tasks = ", ".join(f"{task} at {address}" for task, address in sorted(named.items()))
    for at in warning_times():
        if done.wait(max(0.0, began + at - _view_changes.now())):
            return
        log.warning("TF's update of its view of the cluster has waited %.0f s so far; no step runs until it "
                    "returns. TensorFlow gives it no deadline: it waits for every task it names to answer "
                    "(%s) and for each task it drops or that restarted to close its old context (dropped: "
                    "%s). A task that accepts connections but does not answer (stopped, swapping, behind a "
                    "network that drops packets) holds it: resume, restart or kill that task.",
                    _view_changes.now() - began, tasks or "none", ", ".join(dropped) or "none")
