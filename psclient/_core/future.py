"""`psclient.Future`: the handle `schedule` returns.

It *is* a `concurrent.futures.Future` (a subclass), so everything users know
from the standard library carries over unchanged: `result(timeout)`,
`exception(timeout)`, `done()`, `running()`, `cancel()` (only before the
closure starts), `add_done_callback(fn)`, and the module-level
`concurrent.futures.wait` / `as_completed`. Reusing the stdlib state machine
(PENDING -> RUNNING -> FINISHED, or PENDING -> CANCELLED) also gives the
"resolves exactly once" guarantee for free: a second `set_result` raises
`InvalidStateError`.

A retried closure keeps its future in RUNNING; only the scheduler resolves it.
"""

from __future__ import annotations

import concurrent.futures

__all__ = ["Future", "wait", "as_completed", "ALL_COMPLETED", "FIRST_COMPLETED", "FIRST_EXCEPTION"]

# Re-exported so `psclient.wait(...)` reads naturally next to `psclient.Future`.
wait = concurrent.futures.wait
as_completed = concurrent.futures.as_completed
ALL_COMPLETED = concurrent.futures.ALL_COMPLETED
FIRST_COMPLETED = concurrent.futures.FIRST_COMPLETED
FIRST_EXCEPTION = concurrent.futures.FIRST_EXCEPTION


class Future(concurrent.futures.Future):
    """The outcome of one scheduled function.

    `result()` returns the function's outputs with the same nesting, every
    tensor converted to a numpy value (copied to the coordinator as soon as the
    function finishes, so a worker lost later cannot take the value with it).
    """

    def __init__(self, name: str = "<function>"):
        super().__init__()
        #: Name of the scheduled function, used in errors and logs.
        self.name = name

    def fetch(self, timeout: float | None = None):
        """Alias of `result`, for code written against TF's `RemoteValue.fetch()`."""
        return self.result(timeout)

    def get(self, timeout: float | None = None):
        """Alias of `result`, for code written against TF's `RemoteValue.get()`."""
        return self.result(timeout)

    def __repr__(self) -> str:
        return f"<psclient.Future {self.name!r} state={self._state.lower()}>"
