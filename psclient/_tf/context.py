"""TF's eager context and dispatch context, where no public API reaches.

The coordinator's device names, the server definition a connected coordinator
is pointed at, the worker index a scheduled function reads, the cross-replica
mode of a strategy's scope, TF's `ClosureInputError`, and the automatic
control dependencies of the `tf.function` being traced.
"""

from __future__ import annotations

import contextlib
import copy

import tensorflow as tf
from tensorflow.core.protobuf.tensorflow_server_pb2 import ServerDef
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute.coordinator import coordinator_context
from tensorflow.python.distribute.coordinator.cluster_coordinator import ClosureInputError
from tensorflow.python.eager import context
from tensorflow.python.framework import constant_op, dtypes, ops

from psclient._tf import cluster_view

__all__ = [
    "ClosureInputError",
    "coordinator_cpu",
    "cross_replica_context",
    "current_device",
    "replica_context",
    "current_worker",
    "locked",
    "unordered_checks_and_releases",
    "ensure_initialized",
    "update_server_def",
    "worker_index_scope",
]


def coordinator_cpu() -> str:
    """The coordinator's own CPU device (for state that must not live on a task)."""
    return context.context().host_address_space() + "/device:CPU:0"


def current_device() -> str:
    """The device name in force on this thread (a `tf.device` scope's, else empty)."""
    return context.context().device_name


def ensure_initialized() -> None:
    """Make TF's eager context now (a connected coordinator starts its server, and binds its port, then)."""
    context.ensure_initialized()


def update_server_def(cluster_spec, filters, job_name: str) -> None:
    """Point the running coordinator server at `cluster_spec`, as task 0 of `job_name`."""
    server_def = ServerDef(
        cluster=cluster_spec.as_cluster_def(),
        job_name=job_name,
        task_index=0,
        protocol="grpc",
        default_session_config=copy.deepcopy(context.context().config),
        cluster_device_filters=filters._as_cluster_device_filters(),  # noqa: SLF001
    )
    with cluster_view.changing_view():  # registrations wait for it without the GIL (cluster_view)
        context.context().update_server_def(server_def)


class _WorkerIndex:
    """What TF's dispatch context reads: the index of the worker a call runs on.

    An int64 tensor on the coordinator's CPU, not a Python int: a function
    that reads the index converts it at every call under the worker's device,
    and a Python int converted there is copied to the worker by the
    conversion, which holds the GIL (a hung worker then stopped every thread
    of the coordinator). A tensor is copied by the call, without the GIL.
    """

    __slots__ = ("worker_index",)

    def __init__(self, worker_index: int):
        with ops.init_scope(), ops.device(coordinator_cpu()):
            self.worker_index = constant_op.constant(worker_index, dtypes.int64)


def worker_index_scope(worker: int):
    """A context in which a call runs "on worker `worker`" as far as TF can tell.

    A function that called `tf.distribute.coordinator.experimental_get_current_worker_index()`
    when traced reads the index from TF's thread-local dispatch context each
    time it is called; TF's coordinator enters it around every closure.
    """
    return coordinator_context.with_dispatch_context(_WorkerIndex(worker))


def current_worker() -> int | None:
    """The index of the worker this thread calls (a dispatcher thread's), else None."""
    dispatch = coordinator_context.get_current_dispatch_context()
    return None if dispatch is None else int(dispatch.worker_index)


def replica_context():
    """The one replica's context of TF's default strategy (replica 0 of 1), as `strategy.run` enters.

    Inside it `tf.distribute.in_cross_replica_context()` is False, as in a
    Keras step run without any strategy: Keras code that refuses the
    cross-replica context (`LossScaleOptimizer.apply`) runs as it runs locally.
    """
    return _OneReplicaContext(tf.distribute.get_strategy(), replica_id_in_sync_group=0)


class _OneReplicaContext(tf.distribute.ReplicaContext):
    """TF's replica context, whose `all_reduce` over its one replica returns the values themselves.

    Keras's optimizer sums every step's gradients across replicas with `all_reduce`. TF's, traced
    in a graph, wraps the reduction in a `tf.custom_gradient`, which registers its gradient function
    in TF's process-wide gradient registry for good; that function holds the traced step, so every
    trace of a training step (one per ps recovery, one per strategy) stayed alive with its nested
    functions: about 13,000 objects and 13 graphs a ps recovery, measured, each making Python's
    full garbage collections longer. Over one replica a sum or a mean is the value itself (TF's
    default strategy returns it unchanged, through an identity for the gradient's sake), so
    nothing is registered here, and the step has one op less.
    """

    def all_reduce(self, reduce_op, value, options=None):
        if self.num_replicas_in_sync != 1:  # not psclient's context: TF's own reduction
            return super().all_reduce(reduce_op, value, options)
        return tf.nest.pack_sequence_as(value, tf.nest.flatten(value))


@contextlib.contextmanager
def cross_replica_context():
    """Make `tf.distribute.in_cross_replica_context()` True, as in TF's strategy scope.

    Pushes TF's cross-replica mode for its *default* strategy onto this
    thread's stack (only a real `tf.distribute.Strategy`'s scope does this
    publicly). `tf.distribute.get_strategy()` stays the default one, so Keras
    and TF take the same code paths as without a strategy; only
    `in_cross_replica_context()` / `get_replica_context()` answer as TF's
    parameter-server strategy's scope does.
    """
    mode = distribute_lib._CrossReplicaThreadMode(distribute_lib._get_default_strategy())  # noqa: SLF001
    distribute_lib._push_per_thread_mode(mode)  # noqa: SLF001
    try:
        yield
    finally:
        distribute_lib._pop_per_thread_mode()  # noqa: SLF001


#: Ops a critical section makes that take no resource: TF's automatic control dependencies chain
#: every such stateful op of a function in the order it was made, whatever its device.
_CHECKS_AND_RELEASES = frozenset({"Assert", "ConsumeMutexLock"})


@contextlib.contextmanager
def unordered_checks_and_releases():
    """In a `tf.function`'s trace: the asserts and lock releases made inside still run, but are not
    ordered after the function's other stateful ops that take no resource. (Chained, two critical
    sections on two ps tasks in one step each waited for the other's release: a control edge from
    one ps task to the other every step.) Outside a trace: nothing changes."""
    graph = ops.get_default_graph()
    manager = getattr(graph, "experimental_acd_manager", None)
    start = len(graph.get_operations())
    yield
    if manager is None or not hasattr(manager, "run_independently"):
        return
    for op in graph.get_operations()[start:]:
        if op.type in _CHECKS_AND_RELEASES:
            manager.run_independently(op)


def locked(lock, fn):
    """`lock.execute(fn)` (a `tf.CriticalSection`; `fn`'s reads shared with other sections), its assert
    and release out of TF's order of the step's other ops (`unordered_checks_and_releases`)."""
    with unordered_checks_and_releases():
        return lock.execute(fn, exclusive_resource_access=False)
