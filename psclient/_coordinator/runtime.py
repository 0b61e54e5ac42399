"""The edge where psclient meets TensorFlow's distributed runtime.

Everything here is a thin call into TF's own gRPC runtime (eager remote
execution): connecting the coordinator to the task servers, naming devices,
turning outputs into numpy values. Nothing here decides policy.

The engine (`psclient._engine`: dispatch, probes, recovery, elastic workers)
reaches these functions only through `TFEdge` (engine_edge.py), its `Edge`
protocol on this module; a fake edge stands in for TensorFlow in
`benchmarks/_sim.py` and `tests/_fake_edge.py`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import re
import socket
import threading
import time
from typing import Any

from psclient._coordinator import executors as _executors
from psclient._coordinator.calls import cancellable_call
from psclient._coordinator.executors import (
    function_not_registered_yet,
    streamed_registrations,
    until_registered,
)

from psclient._cluster.spec import Cluster
from psclient._coordinator.connection import COORDINATOR_JOB, connect, disconnect
from psclient._core.errors import TaskUnreachableError

__all__ = [
    "COORDINATOR_JOB",
    "connect",
    "disconnect",
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
    "place_default_updates",
    "coordinator_cpu",
    "worker_index_scope",
    "current_worker",
    "closure_input_error",
    "closure_input_error_type",
    "device_scope",
    "op_error",
    "cross_replica_context",
    "cancellable_call",
    "function_not_registered_yet",
    "streamed_registrations",
    "until_registered",
]

log = logging.getLogger("psclient")

#: The job name the coordinator takes in the cluster (TF's convention).

_PS_DEVICE = re.compile(r"/job:ps/(?:replica:\d+/)?task:(\d+)")


def worker_device(index: int) -> str:
    return f"/job:worker/replica:0/task:{index}"


def ps_device(index: int) -> str:
    return f"/job:ps/replica:0/task:{index}/device:CPU:0"


def ps_index_of(device: str | None) -> int | None:
    """The ps task index named by a device string, or None if it names no ps task."""
    if not device:
        return None
    match = _PS_DEVICE.search(device)
    return int(match.group(1)) if match else None


def tcp_state(address: str, timeout: float) -> str:
    """What a TCP connect to `address` ("host:port") gets within `timeout`.

    "open": something accepts connections. "closed": a definite no (refused,
    unreachable): the process is gone. "silent": no answer at all, as from a
    host cut off by the network; like a hung task, it may answer again.
    """
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return "open"
    except TimeoutError:  # socket.timeout: the connect got no answer in time
        return "silent"
    except OSError:
        return "closed"


def tcp_reachable(address: str, timeout: float) -> bool:
    """Whether something accepts TCP connections at `address` ("host:port")."""
    return tcp_state(address, timeout) == "open"


def wait_reachable(cluster: Cluster, timeout: float) -> None:
    """Wait until every worker and ps task accepts connections, or raise.

    TF's own connect can wait for a missing task far longer than anyone wants
    (gRPC keeps retrying), so the coordinator checks reachability itself first,
    all tasks in parallel, against one deadline.
    """
    deadline = time.monotonic() + timeout
    tasks = cluster.tasks()

    def wait_one(address: str) -> bool:
        while True:
            left = deadline - time.monotonic()
            if tcp_reachable(address, timeout=max(0.05, min(1.0, left))):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            # Back off briefly between attempts; the task may still be starting.
            time.sleep(min(0.2, left))

    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(tasks))) as pool:
        reachable = list(pool.map(lambda t: wait_one(t[2]), tasks))
    missing = [t for t, ok in zip(tasks, reachable) if not ok]
    if missing:
        job, index, address = missing[0]
        names = ", ".join(f"{j}:{i} at {a}" for j, i, a in missing)
        raise TaskUnreachableError(
            f"Cannot reach task {job}:{index} at {address}: nothing accepted a connection "
            f"within connect_timeout={timeout:g} s (unreachable: {names}). Check that "
            "`psclient serve` runs there and that the address and port are right.",
            task=f"{job}:{index}",
            address=address,
        )


def probe(device: str) -> None:
    """One round trip to the task of `device`: a tiny op there, its value back.

    Raises whatever TF raises if the task is gone or lost its state (a
    restarted task no longer knows the coordinator's context). Blocks while
    the task is hung: call it with a timeout (`psclient._core.health.Prober`).
    """
    import tensorflow as tf

    own = getattr(_probe_executors, "executor", None)
    if own is None:
        # Each probing thread calls through an executor of its own, made as the
        # dispatchers' are (`new_call_executor`): on TF's default one, shared
        # with every other thread of the process, a probe of a healthy worker
        # failed with another, dead worker's error.
        own = _probe_executors.executor = _executors.new_call_executor(streaming=False)
    try:
        with _executors.executor_scope(own):
            # The constant is made here, not under the task's device: made there,
            # TF copies it to the task while holding the GIL, and a hung
            # (SIGSTOPped) task then froze every thread of the coordinator until
            # it answered. The op's own copy of its input waits without the GIL.
            with tf.device(coordinator_cpu()):
                one = tf.constant(1, dtype=tf.int32)
            with tf.device(f"{device}/device:CPU:0"):
                (one + 1).numpy()
    except tf.errors.OpError:
        own.clear_error()  # or the next probe on this thread fails with it
        raise


#: The executor of each thread that probes (a pool thread's, for its life).
_probe_executors = threading.local()


def check_handle(variable: Any) -> None:
    """One op on `variable`'s resource on its ps task (its shape: no data moves).

    Raises what TF raises when the task no longer holds that resource: a ps
    restarted since the handle was made (InvalidArgumentError "invalid
    device" once the coordinator reconnected to the new process; Aborted or
    Unavailable before). A tiny-op probe cannot see this: the new process
    answers it once a reconnect has introduced it. Blocks while the task is
    hung: call it with a timeout.
    """
    import tensorflow as tf

    own = getattr(_probe_executors, "executor", None)
    if own is None:
        own = _probe_executors.executor = _executors.new_call_executor(streaming=False)
    try:
        with _executors.executor_scope(own), tf.device(coordinator_cpu()):
            tf.raw_ops.VariableShape(input=variable.handle).numpy()
    except tf.errors.OpError:
        own.clear_error()
        raise


def renew_variable_handle(variable: Any, device: str) -> None:
    """Give `variable` a new, uninitialized resource on `device`.

    After a ps task restarts, the resources of its variables are gone and the
    coordinator's handles to them point nowhere. The user's objects (Keras
    layers, optimizers) hold the `tf.Variable`s themselves, so the variable
    object is kept and only its handle replaced (TF-internal: there is no
    public way). Functions traced before captured the old handle and must be
    traced again. The caller assigns the value (from a checkpoint).
    """
    import tensorflow as tf
    from tensorflow.python.ops import resource_variable_ops

    with tf.device(device):
        handle = resource_variable_ops._variable_handle_from_shape_and_dtype(  # noqa: SLF001
            shape=variable.shape, dtype=variable.dtype, shared_name=None,
            name=variable.name.split(":")[0], graph_mode=False,
        )
    variable._handle = handle  # noqa: SLF001


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
    import tensorflow as tf
    own = _executors.new_call_executor()  # kept referenced: deleting it deletes TF's
    try:
        with _executors.executor_scope(own), tf.device(device), worker_index_scope(worker):
            yield
    finally:
        # An error a call left on it would be raised again when TF deletes it.
        own.clear_error()




def op_error() -> type:
    """The base class of the errors TF's runtime raises for a failed op or call."""
    import tensorflow as tf

    return tf.errors.OpError


def to_numpy(outputs: Any) -> Any:
    """Copy a function's (nested) outputs to the coordinator as numpy values."""
    import tensorflow as tf

    def convert(value):
        if isinstance(value, (tf.Tensor, tf.Variable)):
            return value.numpy()
        return value

    return tf.nest.map_structure(convert, outputs)


def name_error(error: BaseException, fn_name: str, where: str) -> BaseException:
    """The same error, of the same type, saying which scheduled function raised it."""
    import tensorflow as tf

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


def coordinator_cpu() -> str:
    """The coordinator's own CPU device (for state that must not live on a task)."""
    from tensorflow.python.eager import context

    return context.context().host_address_space() + "/device:CPU:0"


# ------------------------------------------------- TF's coordinator contract
class _WorkerIndex:
    """What TF's dispatch context reads: the index of the worker a call runs on."""

    __slots__ = ("worker_index",)

    def __init__(self, worker_index: int):
        self.worker_index = worker_index


def worker_index_scope(worker: int):
    """A context in which a call runs "on worker `worker`" as far as TF can tell (TF-internal).

    A function that called `tf.distribute.coordinator.experimental_get_current_worker_index()`
    when traced reads the index from TF's thread-local dispatch context each
    time it is called; TF's coordinator enters it around every closure.
    """
    from tensorflow.python.distribute.coordinator import coordinator_context

    return coordinator_context.with_dispatch_context(_WorkerIndex(worker))


def current_worker() -> int | None:
    """The index of the worker this thread calls (a dispatcher thread's), else None (TF-internal context)."""
    from tensorflow.python.distribute.coordinator import coordinator_context

    context = coordinator_context.get_current_dispatch_context()
    return None if context is None else context.worker_index


def closure_input_error_type() -> type:
    """TF's `ClosureInputError` class (TF-internal)."""
    from tensorflow.python.distribute.coordinator.cluster_coordinator import ClosureInputError

    return ClosureInputError


def closure_input_error(original: BaseException, message: str) -> Exception:
    """TF's `ClosureInputError` (TF-internal class), with psclient's message.

    TF's coordinator raises it when a scheduled function's per-worker input
    could not be built; code written for TF may catch that class.
    """
    error = closure_input_error_type()(original)
    error.args = (message,)
    return error


# ------------------------------------------- optimizer updates: where they run
_update_placement_lock = threading.Lock()
_update_placement_installed = False


def place_default_updates(device_of) -> None:
    """Run TF's default-strategy variable updates on `device_of(variable)` (TF-internal).

    `strategy.extended.update(var, fn)` made outside any tf.distribute strategy
    (how Keras 3's and tf_keras's optimizers apply each variable's update under
    psclient) ends in `_DefaultDistributionExtended._update_non_slot`, which
    runs `fn` with no device: on the caller. The replacement runs it under
    `tf.device(device)` when `device_of(var)` names a device, as TF's own
    ParameterServerStrategy colocates an update with its variable, and exactly
    as before when it returns None. Installed once per process, class-wide;
    later calls do nothing.
    """
    global _update_placement_installed
    with _update_placement_lock:
        if _update_placement_installed:
            return
        import tensorflow as tf
        from tensorflow.python.distribute import distribute_lib

        extended = distribute_lib._DefaultDistributionExtended  # noqa: SLF001
        stock = extended._update_non_slot  # noqa: SLF001

        def _update_non_slot(self, colocate_with, fn, args, kwargs, should_group):
            device = device_of(colocate_with)
            if device is None:
                return stock(self, colocate_with, fn, args, kwargs, should_group)
            with tf.device(device):
                return stock(self, colocate_with, fn, args, kwargs, should_group)

        _update_non_slot.__doc__ = "TF's default-strategy update, on its variable's device (psclient)."
        _update_non_slot.__wrapped__ = stock
        extended._update_non_slot = _update_non_slot  # noqa: SLF001
        _update_placement_installed = True


@contextlib.contextmanager
def cross_replica_context():
    """Make `tf.distribute.in_cross_replica_context()` True, as in TF's strategy scope.

    Pushes TF's cross-replica mode for its *default* strategy onto this
    thread's stack (TF-internal: only a real `tf.distribute.Strategy`'s scope
    does this publicly). `tf.distribute.get_strategy()` stays the default one,
    so Keras and TF take the same code paths as without a strategy; only
    `in_cross_replica_context()` / `get_replica_context()` answer as TF's
    parameter-server strategy's scope does.
    """
    from tensorflow.python.distribute import distribute_lib

    mode = distribute_lib._CrossReplicaThreadMode(distribute_lib._get_default_strategy())  # noqa: SLF001
    distribute_lib._push_per_thread_mode(mode)  # noqa: SLF001
    try:
        yield
    finally:
        distribute_lib._pop_per_thread_mode()  # noqa: SLF001

