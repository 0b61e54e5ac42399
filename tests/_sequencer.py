"""Interleavings staged for real threads, without touching private fields (as Trio's `Sequencer`).

`HeldBackLock` is a lock that a test hands to the object under test (`Scheduler(lock=...)`): a
blocking acquire by the one thread the test chose waits at a gate until the test lets it go, and
says when it got there. So "that thread was woken and wants the lock back, and this happens before
it gets it" is staged exactly, by the code's own public calls, not hoped for with sleeps.
"""

from __future__ import annotations

import threading


class HeldBackLock:
    """A `threading.Lock` whose blocking acquires by a chosen thread wait until `let_go()`."""

    def __init__(self):
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._open = threading.Event()
        self._open.set()
        #: Set when the chosen thread reached the gate (it wants the lock and is held back).
        self.arrived = threading.Event()

    def hold_back(self, thread: threading.Thread) -> None:
        """From now on `thread` waits at the gate before each blocking acquire."""
        self._thread = thread
        self.arrived.clear()
        self._open.clear()

    def let_go(self) -> None:
        self._open.set()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if blocking and threading.current_thread() is self._thread and not self._open.is_set():
            self.arrived.set()
            if not self._open.wait(30):  # bounded: a test that forgot let_go() fails, never hangs
                raise TimeoutError("HeldBackLock: the test never let the held thread go")
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
