"""The edge where psclient meets TensorFlow's distributed runtime.

Everything here is a thin call into TF's own gRPC runtime (eager remote
execution): connecting the coordinator to the task servers, naming devices,
turning outputs into numpy values. Nothing here decides policy. What needs
TF's internals comes from `psclient._tf`; the TF-free task helpers (device
names, reachability) from `psclient._cluster.tasks`.

The engine (`psclient._engine`: dispatch, probes, recovery, elastic workers)
reaches these functions only through `TFEdge` (engine_edge.py), its `Edge`
protocol on this module; a fake edge stands in for TensorFlow in
`benchmarks/_sim.py` and `tests/_fake_edge.py`.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import tensorflow as tf

from psclient._cluster.tasks import (
    ps_device,
    ps_index_of,
    tcp_reachable,
    tcp_state,
    wait_reachable,
    worker_device,
)
from psclient._coordinator.connection import COORDINATOR_JOB, connect, connection_changes, disconnect, view_changes
from psclient._tf import executors as _executors
from psclient._tf import variables as _variables
from psclient._tf.calls import cancellable_call, probing_call
from psclient._tf.context import (
    ClosureInputError,
    coordinator_cpu,
    cross_replica_context,
    current_worker,
    replica_context,
    worker_index_scope,
)
from psclient._tf.executors import streamed_registrations
from psclient._tf.registrations import function_not_registered_yet, until_registered

__all__ = [
    "COORDINATOR_JOB",
    "connect",
    "connection_changes",
    "disconnect",
    "view_changes",
    "worker_device",
    "ps_device",
    "ps_index_of",
    "tcp_reachable",
    "tcp_state",
    "wait_reachable",
    "to_numpy",
    "name_error",
    "probe",
    "renew_variable_handle",
    "coordinator_cpu",
    "worker_index_scope",
    "current_worker",
    "closure_input_error",
    "closure_input_error_type",
    "device_scope",
    "op_error",
    "cross_replica_context",
    "replica_context",
    "cancellable_call",
    "function_not_registered_yet",
    "streamed_registrations",
    "until_registered",
]

log = logging.getLogger("psclient")


def probe(device: str) -> None:
    """One round trip to the task of `device`: a tiny op there, its value back.

    Raises whatever TF raises if the task is gone or lost its state (a
    restarted task no longer knows the coordinator's context). Blocks while
    the task is hung: call it with a timeout (`psclient._core.health.Prober`).
    """
    with _probing():
        # An op without inputs: nothing is converted under the task's device
        # (a Python value converted there is copied to the task by the
        # conversion, holding the GIL: a hung task froze every thread of the
        # coordinator; tests/strategy/test_no_remote_conversions.py checks every
        # such place), and nothing is copied there first. The probe's operand
        # used to be a coordinator constant that the op copied to the task: in a
        # seeded chaos plan that copy was lost to a reconnect of the cluster, and
        # the probe of a ps that answered failed with TF's "Unable to find the
        # relevant tensor remote_handle" (and the `fit` whose export made it).
        with tf.device(f"{device}/device:CPU:0"):
            tf.raw_ops.Timestamp().numpy()


@contextlib.contextmanager
def _probing():
    """A probe's ops inside: through this thread's own executor (`executors.on_thread_executor`: on
    TF's default one, shared with every other thread of the process, a probe of a healthy worker
    failed with another, dead worker's error), counted by TF's cache-clearing gate."""
    with probing_call(), _executors.on_thread_executor():
        yield


def check_handle(variable: Any) -> None:
    """One op on `variable`'s resource on its ps task (its shape: no data moves).

    Raises what TF raises when the task no longer holds that resource: a ps
    restarted since the handle was made (InvalidArgumentError "invalid
    device" once the coordinator reconnected to the new process; Aborted or
    Unavailable before). A tiny-op probe cannot see this: the new process
    answers it once a reconnect has introduced it. Blocks while the task is
    hung: call it with a timeout.
    """
    with _probing(), tf.device(coordinator_cpu()):
        tf.raw_ops.VariableShape(input=variable.handle).numpy()


def renew_variable_handle(variable: Any, device: str) -> None:
    """Give `variable` a new, uninitialized resource on `device`.

    After a ps task restarts, the resources of its variables are gone and the
    coordinator's handles to them point nowhere. The user's objects (Keras
    layers, optimizers) hold the `tf.Variable`s themselves, so the variable
    object is kept and only its handle replaced (TF-internal: there is no
    public way). Functions traced before captured the old handle and must be
    traced again. The caller assigns the value (from a checkpoint).
    """
    _variables.renew_handle(variable, device)


@contextlib.contextmanager
def device_scope(device: str, worker: int):
    """Ops and calls made inside run on `device`, as worker `worker`'s (a dispatcher thread's whole life).

    Also TF's worker index (`experimental_get_current_worker_index()` in a
    scheduled function): this thread only ever calls this worker. And an
    executor of this thread's own (TF's own coordinator gives each worker one
    too): with the process-wide default one, a call failing on a worker just
    restarted surfaced its error in another thread's next op (a user's
    `v.assign(...)` raised the worker's UnavailableError), and a call to a hung
    worker made other threads' ops wait. Unary at pipeline depth 1, so a
    dead task's error comes back to the caller.
    """
    own = _executors.new_call_executor()  # kept referenced: deleting it deletes TF's
    try:
        with _executors.executor_scope(own), tf.device(device), worker_index_scope(worker):
            yield
    finally:
        # An error a call left on it would be raised again when TF deletes it.
        own.clear_error()


def op_error() -> type:
    """The base class of the errors TF's runtime raises for a failed op or call."""
    return tf.errors.OpError


def to_numpy(outputs: Any) -> Any:
    """Copy a function's (nested) outputs to the coordinator as numpy values."""

    def convert(value):
        if isinstance(value, (tf.Tensor, tf.Variable)):
            return value.numpy()
        return value

    return tf.nest.map_structure(convert, outputs)


def name_error(error: BaseException, fn_name: str, where: str) -> BaseException:
    """The same error, of the same type, saying which scheduled function raised it."""
    context = f"scheduled function {fn_name!r} failed on {where}"
    if isinstance(error, tf.errors.OpError):
        # TF errors carry their message in a field; rebuild with the context in
        # front so str(error) tells the whole story, and keep the original as cause.
        try:
            named = type(error)(error.node_def, error.op, f"{context}: {error.message}")
        except TypeError:  # a subclass with another constructor
            named = None
        if named is not None:
            named.__cause__ = error
            return named
    if hasattr(error, "add_note"):
        error.add_note(context)
    return error


def closure_input_error_type() -> type:
    """TF's `ClosureInputError` class (TF-internal)."""
    return ClosureInputError


def closure_input_error(original: BaseException, message: str) -> Exception:
    """TF's `ClosureInputError` (TF-internal class), with psclient's message.

    TF's coordinator raises it when a scheduled function's per-worker input
    could not be built; code written for TF may catch that class.
    """
    error = ClosureInputError(original)
    error.args = (message,)
    return error
