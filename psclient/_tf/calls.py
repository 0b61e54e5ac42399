"""How a dispatcher's call is made cancellable, and kept out of TF's cache clearing.

The dispatcher reaches it through its edge (`runtime.cancellable_call`).
"""

from __future__ import annotations

import contextlib
import logging
import threading

import tensorflow as tf
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import cancellation, context

__all__ = ["cancellable_call", "probing_call"]

log = logging.getLogger("psclient")

# TF finds the cancellation manager of a call in one process-wide global
# (`cancellation.context()`), which threads calling at once would overwrite;
# psclient's calls keep theirs per thread.
_thread_cancellation = threading.local()
_cancellation_lock = threading.Lock()
_cancellation_installed = False


def _install_thread_cancellation() -> None:
    global _cancellation_installed
    with _cancellation_lock:
        if _cancellation_installed:
            return
        global_context = cancellation.context

        def context():
            manager = getattr(_thread_cancellation, "manager", None)
            return manager if manager is not None else global_context()

        cancellation.context = context
        _cancellation_installed = True


class _CallGate:
    """Counts psclient's calls in flight; holds new ones while TF clears its caches.

    TF's cache clearing (`tf.random.set_seed`, `clear_kernel_cache`) waits,
    with the GIL held, for every call in flight in the process: one on a hung
    worker froze every thread, so also the one that would take the worker out
    and cancel the call. Cleared through this gate, it first waits with the
    GIL released until no call runs and lets no new call start until it is
    done. A call stops counting once it is cancelled (its worker taken out,
    or its strategy shut down): above pipeline depth 1 a cancelled call can
    still wait in TF for a hung or lost worker's answer, and the clearing
    then waited for it for good. TF's clearing does not wait for such a call
    (it is waited for outside its executor: `executors.unregistered_executor`).
    Health probes count too (`probing_call`): TF's clearing waited, GIL held,
    for a probe of a hung task, which froze every thread until the task
    answered. What still freezes it: anything else in flight to a hung task
    (a remote handle's deletion; docs/development.md, known limits).
    """

    def __init__(self):
        self._cond = threading.Condition()
        self._running = 0
        self._clearing = 0

    @contextlib.contextmanager
    def call(self, *, held: bool = True):
        """Counts the call made inside; yields `leave()`, which stops counting it (once).

        `held`: whether it waits while a clearing is pending. A health probe is
        not held: probes stopped behind a clearing made every task look hung.
        """
        with self._cond:
            while held and self._clearing:
                self._cond.wait()
            self._running += 1
        counted = True

        def leave():
            nonlocal counted
            with self._cond:
                if counted:
                    counted = False
                    self._running -= 1
                    self._cond.notify_all()

        try:
            yield leave
        finally:
            leave()

    @property
    def running(self) -> int:
        with self._cond:
            return self._running

    def clear(self, clear_caches, handle, warn_every: float = 10.0) -> None:
        with self._cond:
            self._clearing += 1
            try:
                waited = 0.0
                while self._running:
                    if not self._cond.wait(warn_every):
                        waited += warn_every
                        log.warning("clearing TensorFlow's caches (tf.random.set_seed?) waits for %d "
                                    "call(s) running on workers (%.0f s so far)", self._running, waited)
                clear_caches(handle)
            finally:
                self._clearing -= 1
                self._cond.notify_all()


_call_gate = _CallGate()
_gate_installed = False


def _install_cache_clearing_gate() -> None:
    global _gate_installed
    with _cancellation_lock:
        if _gate_installed:
            return
        original = pywrap_tfe.TFE_ContextClearCaches
        # Not through ctypes without the GIL: while it waits for a hung
        # task's nodes it holds TF's kernel-cache lock, which stopped every
        # other TF op of the process (health probes too: tasks looked lost).
        pywrap_tfe.TFE_ContextClearCaches = lambda handle: _call_gate.clear(original, handle)
        _gate_installed = True


@contextlib.contextmanager
def probing_call():
    """A health probe's op made inside is waited for by TF's cache clearing, GIL released (`_CallGate`)."""
    _install_cache_clearing_gate()
    with _call_gate.call(held=False):
        yield


@contextlib.contextmanager
def cancellable_call():
    """The call this thread makes inside can be cancelled: yields a `cancel()` for any thread.

    A cancelled call returns at once with CancelledError (the RPC is cancelled
    on the coordinator's side), also when its worker hangs: a dispatcher
    thread is not held by a hung worker after it was taken out. The call
    also passes the gate of TF's cache clearing (`_CallGate`).
    """
    _install_thread_cancellation()
    _install_cache_clearing_gate()
    manager = cancellation.CancellationManager()  # one per call: a cancelled one stays cancelled
    with _call_gate.call() as leave_gate:

        def cancel():
            leave_gate()  # first: a call TF cannot cancel must not hold the gate
            manager.start_cancel()

        _thread_cancellation.manager = manager
        try:
            yield cancel
        except tf.errors.OpError:
            _settle_after_error()
            raise
        finally:
            _thread_cancellation.manager = None


def _settle_after_error() -> None:
    """Wait for this thread's executor to finish the failed call's nodes, then clear its error.

    A failed call leaves its error on the executor, which would raise it
    again at the next wait. Above pipeline depth 1 the call's error can
    reach the caller (its output's wait) before the executor has finished
    the call's node, which then set the error again after it was cleared:
    the next wait, by the Python wrapper that `context().executor` makes and
    whose deletion waits, raised it as "Exception ignored in Executor.__del__"
    (32 times in 600 failing calls), and the executor kept the error. The
    wait is the one the wrapper's deletion did anyway, made first.
    """
    own = context.context().executor
    try:
        own.wait()
    except tf.errors.OpError:
        pass  # the failed call's own error, raised again by the wait
    own.clear_error()
