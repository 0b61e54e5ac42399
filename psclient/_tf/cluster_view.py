"""Registrations wait, without the GIL, while TF's view of the cluster changes.

TF's `update_server_def` (a connect, or a reconnect of the recovery thread)
holds TF's context lock until every task it names has answered, and until
every node pending on TF's default executor has ended: with a ps
SIGSTOPped, for as long as the ps hangs. It waits without the GIL. A
function registered meanwhile (`Context.add_c_function` and the like, from
any trace) waits for the same lock inside TF *with* the GIL held, and every
thread of the coordinator stopped until the ps answered (two chaos plans:
3.5 and 4.8 s; tests/faults/test_no_freeze.py, 16.7 s before this gate).

So the registrations psclient wraps (`psclient._tf.executors`) pass
`registration_gate()` first: while another thread is inside
`changing_view()` they wait here, in Python, and the rest of the
coordinator runs on. A view change waits, the same way, for registrations
already past the gate (quick: a streamed one is only queued), and at its end
for those it held back to pass (at most `DRAIN_S` each time). The thread that changes
the view passes its own gate (a garbage collection in it may remove a
function).
"""

from __future__ import annotations

import contextlib
import threading

__all__ = ["changing_view", "registration_gate"]

_gate = threading.Condition()  # its lock is reentrant: a collection may run while a thread holds it
_changing: threading.Thread | None = None  # the thread inside `changing_view`
_registering = 0  # threads past the gate, inside TF
_waiting = 0  # threads held at the gate by a view change
#: How long a view change's thread waits, before and after it, for registrations inside TF or
#: held at the gate (a registration not streamed can wait on a hung task): then it goes on anyway.
DRAIN_S = 5.0


@contextlib.contextmanager
def changing_view():
    """Around TF's `update_server_def`: registrations wait until it returns."""
    global _changing
    with _gate:
        _gate.wait_for(lambda: _changing is None)  # one at a time (connections take turns already)
        _gate.wait_for(lambda: not _registering, DRAIN_S)
        _changing = threading.current_thread()
    try:
        yield
    finally:
        with _gate:
            _changing = None
            _gate.notify_all()
            # The registrations held back go first (bounded), before this thread goes on: a
            # streamed one turns TF's process-wide streaming switch on, and this thread's next
            # eager ops (a connect's caller builds variables) sent meanwhile partly down the
            # stream and partly not could reach a task out of order.
            _gate.wait_for(lambda: not _waiting and not _registering, DRAIN_S)


@contextlib.contextmanager
def registration_gate():
    """Around a call that registers or removes a function on every task (module doc)."""
    global _registering, _waiting
    me = threading.current_thread()
    with _gate:
        if not (_changing is None or _changing is me):
            _waiting += 1
            try:
                _gate.wait_for(lambda: _changing is None or _changing is me)
            finally:
                _waiting -= 1
        _registering += 1
    try:
        yield
    finally:
        with _gate:
            _registering -= 1
            _gate.notify_all()
