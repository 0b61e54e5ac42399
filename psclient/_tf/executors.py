"""The executors psclient's TF calls go through, and streamed registrations.

TF runs a thread's eager ops and function calls through that thread's
executor: TF's default one is shared by every thread of the process. Each
dispatcher thread calls through one of its own (`new_call_executor`), and
traces register their functions on every task through a streaming one
(`streamed_registrations`), so that a hung task holds neither. A thread
that traces as it goes (an export) streams its registrations only
(`streamed_function_registrations`, which wraps TF's `Context.add_c_function`,
`add_function_def` and `remove_function`: TF internals). Once connected, every
thread's removals of dropped functions are streamed too: a garbage collection
can drop one anywhere, a `schedule()` included. Eager ops that TF would wrap in
a function of their own, registered on every task from inside its C++, can run
as themselves for a while (`eager_ops_as_themselves`, a serving loader's).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading

import tensorflow as tf
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import context, executor

from psclient._tf import cluster_view

__all__ = [
    "eager_ops_as_themselves",
    "eager_ops_as_themselves_from_now",
    "executor_scope",
    "local_device_in_force",
    "new_call_executor",
    "on_thread_executor",
    "register_read_kinds",
    "register_summary_kinds",
    "set_streaming_env",
    "streamed_function_registrations",
    "streamed_registrations",
    "unregistered_executor",
]

#: Whether dispatcher threads call through streaming executors (pipeline depth > 1).
_calls_stream = False


def new_call_executor(streaming: bool | None = None):
    """A synchronous executor for one dispatcher (or probing) thread: unary
    calls at pipeline depth 1 (a dead task's error comes back), streaming
    above (`streaming`: as the dispatchers' when None). A streamed call
    returns once it is sent: the tracer makes each dispatcher call wait for
    the worker's answer (psclient/_coordinator/completion.py).

    Made without TF's "async wait for remote functions": before a call of a
    function with inputs on other tasks (a step reading ps variables), such
    an executor syncs *every* task of the cluster whenever the call goes to
    another worker's client than its previous one did. A dispatcher thread
    only ever calls its own worker and waits for each call's outputs, so the
    sync protects nothing here; but a reconnect gives every worker a new
    client, so after each one every dispatcher's next call synced the whole
    cluster, and with a dead worker still in TF's view that sync failed, on
    every call, naming the dead worker: healthy workers' calls failed for as
    long as it stayed in the view (TF does not forget the stale client when
    the sync fails), then with "Client for target ... not found" once it was
    dropped. TF reads the switch when it makes the executor.
    """
    with _env_lock:
        # Set back afterwards, to TF's default when it was unset, never removed:
        # TF's threads read the environment while this runs.
        saved = os.environ.get(_ASYNC_WAIT_ENV, "true")
        os.environ[_ASYNC_WAIT_ENV] = "false"
        try:
            return executor.new_executor(
                enable_async=False, enable_streaming_enqueue=_calls_stream if streaming is None else streaming)
        finally:
            os.environ[_ASYNC_WAIT_ENV] = saved


def set_streaming_env(streaming: bool) -> None:
    """Whether dispatcher threads' calls stream (connect sets it); from then on
    every function dropped is removed from the tasks without being waited for
    (`_install_registration_hook`)."""
    global _calls_stream
    _install_registration_hook()
    with _env_lock:
        _calls_stream = streaming
        if not _streamed_traces:
            os.environ[_STREAMING_ENV] = str(streaming)


_STREAMING_ENV = "TF_ENABLE_EAGER_CLIENT_STREAMING_ENQUEUE"
_ASYNC_WAIT_ENV = "TF_ENABLE_ASYNC_WAIT_FOR_REMOTE_FUNCTION"
# Reentrant: a function dropped by a garbage collection that runs while this
# thread holds it is removed through `streamed_registrations`, which takes it.
_env_lock = threading.RLock()
#: Threads inside `streamed_registrations` (the env stays True while any is).
_streamed_traces = 0
_streaming_executor = None


@contextlib.contextmanager
def streamed_registrations():
    """Inside, what TF registers on every task (a traced function, an eager
    op's kernel) goes down each task's stream without waiting for the answers.

    TF registers a new function on every task of the cluster with a blocking
    RPC per task, holding the GIL: one hung worker froze the whole coordinator
    for as long as it hung (a checkpoint saver traced, a new function
    scheduled, Keras building its train function). Streamed, the registration
    is queued and the trace returns. TF streams when the calling thread's
    executor allows it and the environment switch is on (read at every
    enqueue), so the trace runs on a streaming executor (one for the
    process) and the switch is on while any thread traces. Other threads'
    ops made meanwhile on TF's default executor stream too (a health probe:
    it is waited for with a timeout anyway). A call that overtakes
    its function's registration on a worker is made again
    (`function_not_registered_yet`).
    """
    global _streamed_traces, _streaming_executor

    with _env_lock:
        if _streaming_executor is None:
            # One for the process, never deleted: TF's Executor waits, when
            # deleted, for everything sent through it, a registration still
            # on its way to a hung task included (a trace then stalled until
            # the task answered).
            _streaming_executor = _kept_streaming_executor()
        # A streamed registration that failed (a task gone) leaves its error
        # on the executor, which would fail the next trace with it.
        _streaming_executor.clear_error()
        _streamed_traces += 1
        os.environ[_STREAMING_ENV] = "True"
    try:
        with executor_scope(_streaming_executor):
            yield
    finally:
        with _env_lock:
            _streamed_traces -= 1
            if not _streamed_traces:
                os.environ[_STREAMING_ENV] = str(_calls_stream)


#: Threads inside `eager_ops_as_themselves`, and the lock that guards the count and TF's switch.
_unwrapped_users = 0
_unwrapped_lock = threading.Lock()
#: Whether `eager_ops_as_themselves_from_now` counted itself among those users, for good.
_unwrapped_for_good = False


@contextlib.contextmanager
def eager_ops_as_themselves():
    """Inside (while any thread is), TF runs each eager op as itself, not wrapped in a one-op
    function (TF's "run eager op as function", on by default).

    TF registers each wrapping function, one per new kind of op (op, dtypes, shapes), on every
    task of the cluster the process is connected to, with an RPC per task that it waits for,
    also for an op that runs here: loading a SavedModel in a connected coordinator (a serving
    loader) waited for a SIGSTOPped worker for as long as it hung (60 s, its watchdog; 0.13 s
    with this switch off). Unwrapped, a local op touches no task, and a remote one is sent as
    an op. The switch is TF's own and process-wide (`TFE_ContextSetRunEagerOpAsFunction`):
    other threads' eager ops meanwhile run unwrapped too, which TF supports as well.
    """
    global _unwrapped_users
    with _unwrapped_lock:
        if not _unwrapped_users:
            _set_run_eager_op_as_function(False)
        _unwrapped_users += 1
    try:
        yield
    finally:
        with _unwrapped_lock:
            _unwrapped_users -= 1
            if not _unwrapped_users:
                _set_run_eager_op_as_function(context.run_eager_op_as_function_enabled())


def eager_ops_as_themselves_from_now() -> None:
    """From now on, for the rest of the process, TF runs each eager op as itself
    (`eager_ops_as_themselves`, entered for good): a connected coordinator's.

    Any new kind of eager op the coordinator's process runs, psclient's own or the user's
    (a callback's, a metric computed between fits, a SavedModel loaded), otherwise waited for
    every task, a hung one for as long as it hung (36 s for a `tf.linalg.det` after a fit,
    until a watchdog resumed the worker; taken out of training or not, TF's view keeps it).
    """
    global _unwrapped_for_good, _unwrapped_users
    with _unwrapped_lock:
        if _unwrapped_for_good:
            return
        _unwrapped_for_good = True
        if not _unwrapped_users:
            _set_run_eager_op_as_function(False)
        _unwrapped_users += 1  # never taken back: the switch stays off


def _set_run_eager_op_as_function(on: bool) -> None:
    ctx = context.context()
    ctx.ensure_initialized()
    pywrap_tfe.TFE_ContextSetRunEagerOpAsFunction(ctx._handle, on)


#: .on: whether this thread streams its function registrations (`streamed_function_registrations`).
_registering = threading.local()
_hook_lock = threading.Lock()
_hook_installed = False


@contextlib.contextmanager
def streamed_function_registrations():
    """Inside, on this thread, each new function's registration on every task is streamed
    (`streamed_registrations`), and nothing else: the thread's eager ops go as before.

    For a long piece of work that traces as it goes (an export): a registration
    waiting on a hung task would hold the GIL, while an eager op sent down a
    stream to a task that died waited for it instead of failing.
    """
    _install_registration_hook()
    outer = getattr(_registering, "on", False)
    _registering.on = True
    try:
        yield
    finally:
        _registering.on = outer


def _install_registration_hook() -> None:
    """Wrap TF's `Context.add_c_function`, `add_function_def` (where a trace registers its function
    on every task) and `remove_function` (where a function dropped is removed from every task) once:
    registrations streamed on a thread inside `streamed_function_registrations`, removals always;
    each of them waits, without the GIL, while a reconnect changes TF's view (`cluster_view`).

    TF removes a function from every task when its last Python reference goes
    (`AtomicFunction.__del__`), with an RPC per task that it waits for with the
    GIL held. That happens wherever a garbage collection or a dropped cache
    entry frees an old trace: a `schedule()` tracing a new step while a ps was
    SIGSTOPped freed an earlier test's function and held every thread of the
    coordinator until the ps answered (140 s, the watchdog;
    tests/faults/test_first_run_beside_hung_ps.py). A removal nobody waits
    for can go down the stream like a registration.
    """
    global _hook_installed
    if _hook_installed:  # read without the lock: every served call passes here (psclient.serving)
        return
    with _hook_lock:
        for name in ("add_c_function", "add_function_def", "remove_function"):
            stock = getattr(context.Context, name)
            if getattr(stock, "_psclient_streamed", False):
                continue
            always = name == "remove_function"

            def wrapped(self, function, _stock=stock, _always=always):
                with cluster_view.registration_gate():  # not inside TF while a reconnect holds its lock
                    if _always or getattr(_registering, "on", False):
                        with streamed_registrations():
                            return _stock(self, function)
                    return _stock(self, function)

            wrapped._psclient_streamed = True
            wrapped.__doc__, wrapped.__name__ = stock.__doc__, stock.__name__
            setattr(context.Context, name, wrapped)
        _hook_installed = True


@contextlib.contextmanager
def on_thread_executor():
    """Inside, this thread's ops go through a unary executor of its own (made at the thread's first
    use, kept for its life), as the dispatchers' and per-ps calls' do. Probes go through it too.

    For psclient's calls made on a caller's thread or the recovery's (probes, reads and writes of ps
    state, per-worker values built again): on TF's default executor, shared by every thread of the
    process, the ops to one task go down one stream, and an error there reaches whichever thread's
    op comes next (in a seeded chaos plan another thread's "not registered" failed a `fit`'s
    metric read), while a wait there holds every thread's ops behind it.
    """
    own = getattr(_thread_executors, "executor", None)
    if own is None:
        own = _thread_executors.executor = new_call_executor(streaming=False)
    try:
        with executor_scope(own):
            yield
    finally:
        own.clear_error()  # an error caught inside, or raised: the thread's next call does not fail with it


#: Each thread's own executor (`on_thread_executor`).
_thread_executors = threading.local()


@contextlib.contextmanager
def executor_scope(executor_in_scope):
    """TF's `context.executor_scope`, without waiting for the executor it replaces.

    TF's wraps the thread's previous executor in a Python `Executor` whose
    deletion (when the scope ends) waits for every node pending on it: the
    default executor's, a health probe's op to a hung task included; a
    `schedule()` then stalled until the task answered.
    """
    ctx = context.context()
    ctx.ensure_initialized()
    handle = ctx._context_handle  # noqa: SLF001 - TF's own scope uses it the same way
    previous = _UnwaitedExecutor(pywrap_tfe.TFE_ContextGetExecutorForThread(handle),
                                 pywrap_tfe.TFE_DeleteExecutor)
    pywrap_tfe.TFE_ContextSetExecutorForThread(handle, executor_in_scope.handle())
    scopes = _scopes.__dict__.setdefault("stack", [])
    scopes.append((handle, executor_in_scope, previous))
    try:
        yield
    finally:
        scopes.pop()
        pywrap_tfe.TFE_ContextSetExecutorForThread(handle, previous.handle())


_scopes = threading.local()  # each thread's `executor_scope`s: (context handle, in scope, replaced)


@contextlib.contextmanager
def unregistered_executor():
    """Inside, this thread's executor is the one its innermost `executor_scope` replaced.

    For a wait on a streamed call's answer (psclient/_coordinator/completion.py):
    TF's cache clearing (`tf.random.set_seed`) waits, with the GIL held, for
    every node pending on every thread's registered executor. A streamed call
    is such a node until its worker answers, and one whose answer never came
    (its worker killed, the call abandoned by a shutdown) froze the whole
    process at the next `set_seed`. Waited for outside its executor, it
    holds up nothing but its own thread. Outside an `executor_scope`, nothing
    changes.
    """
    scopes = getattr(_scopes, "stack", None)
    if not scopes:
        yield
        return
    handle, in_scope, replaced = scopes[-1]
    pywrap_tfe.TFE_ContextSetExecutorForThread(handle, replaced.handle())
    try:
        yield
    finally:
        pywrap_tfe.TFE_ContextSetExecutorForThread(handle, in_scope.handle())


class _UnwaitedExecutor:
    """A borrowed TF executor handle, freed (not waited for) when dropped."""

    __slots__ = ("_handle", "_delete")

    def __init__(self, handle, delete):
        self._handle = handle
        self._delete = delete

    def handle(self):
        return self._handle

    def __del__(self):
        # Only the wrapper goes: the executor belongs to TF's context.
        self._delete(self._handle)


def _kept_streaming_executor():
    """A streaming executor that is never waited for nor deleted (see `streamed_registrations`)."""
    class _Kept(executor.Executor):
        __slots__ = ()

        def __del__(self):
            pass  # TF's waits for nodes still on their way to a hung task

    return _Kept(pywrap_tfe.TFE_NewExecutor(False, True, 0))


#: (dtype, shards) whose reads on the coordinator have their kinds registered (`register_read_kinds`).
_read_kinds: set = set()


def register_read_kinds(dtype, shards: int = 1) -> None:
    """Registers, streamed, the local ops that reading a ps variable of `dtype` (of `shards`
    shards) runs on the coordinator, once per process.

    A variable's `numpy()` (Keras's `get_weights`, `EarlyStopping`'s best weights, an
    optimizer's config) reads it on its ps, then copies the value here with an `Identity`, and a
    partitioned one concatenates its shards here: local ops, but TF registers each new kind on
    every task first, and one hung worker held such a read until it answered. (The read on
    the ps is registered on that ps only.) Only local ops inside the streamed scope.
    """
    key = (tf.as_dtype(dtype), shards)
    if key in _read_kinds:
        return
    with tf.init_scope():
        if not local_device_in_force():
            return  # Keras colocating a slot with its variable: made for another variable
        with streamed_registrations():
            zero = tf.zeros([1], dtype)
            tf.identity(zero)
            if shards > 1:
                tf.concat([zero] * shards, axis=0)
    _read_kinds.add(key)


def local_device_in_force() -> bool:
    """Whether this thread's eager ops run on the coordinator: no device scope naming a task.

    What is made to register kinds streamed must be local (a streamed op to a task that dies
    waits for good), and a kind made on another device is another kind.
    """
    device = context.context().device_name
    return not device or device.startswith(context.context().host_address_space())


def register_summary_kinds() -> None:
    """Runs, on a throwaway file writer, the kinds of eager op a `tf.summary` writer runs
    for Keras's TensorBoard callback, their registrations streamed.

    The callback creates its writers when fit makes its callbacks, and writes scalars at
    each epoch's end (and steps per second, when asked): local ops, but TF registers each
    new kind on every task first, and one hung worker held fit there until it answered.
    Made here first, streamed (only local ops inside), the callback's own are no longer new.
    Histograms, images, embeddings and the profiler run more kinds, not made here.
    """
    def write(directory):  # its writer deleted on return, inside the scope: a deletion is an op too
        writer = tf.summary.create_file_writer(directory)
        with writer.as_default(step=0):
            tf.summary.scalar("scalar", 0.0, step=0)
            tf.summary.write("text", tf.constant(""), step=0)  # the model's summary
        # Steps per second: an int64 step count made float32, less the epoch's first, over seconds.
        _ = (tf.cast(tf.constant(1, tf.int64), tf.float32) - tf.constant(0.0)) / tf.constant(1.0)
        writer.flush()
        writer.close()

    if not local_device_in_force():
        return
    with streamed_registrations(), tempfile.TemporaryDirectory(prefix="psclient-summaries-") as directory:
        write(directory)
