"""One scheduled call, as the scheduler and the dispatchers see it: pure data."""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import threading
from typing import Any, Callable, Iterator

from psclient._core.future import Future

__all__ = ["Closure", "cancel_all", "outputs_unread"]

_ids = itertools.count()


class _Scheduling(threading.local):
    """How the calling thread schedules now (`outputs_unread`)."""

    outputs_unread = False


_scheduling = _Scheduling()


@contextlib.contextmanager
def outputs_unread() -> Iterator[None]:
    """Closures made in this thread meanwhile leave their outputs on the worker.

    Their call still runs synchronously and its errors are handled as any
    call's; only the copy of the outputs to the coordinator is left out, and
    the future is resolved with None. For callers that never read a result
    (the Keras trainer's steps whose logs no callback reads): the copy costs
    a worker more than the rest of a small call. `strategy.schedule()` alone
    never enters this, so its futures always hold values.
    """
    before, _scheduling.outputs_unread = _scheduling.outputs_unread, True
    try:
        yield
    finally:
        _scheduling.outputs_unread = before


class Closure:
    """One scheduled call: the function, its arguments and its future."""

    __slots__ = (
        "id", "fn", "args", "kwargs", "future", "attempts", "started_at", "per_worker",
        "worker", "function", "unexplained_failures", "other_lost_failures", "copy_outputs", "generation",
    )

    def __init__(self, fn: Callable, args: tuple, kwargs: dict, future: Future):
        self.id = next(_ids)
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.future = future
        self.attempts = 0
        #: Failed attempts whose connection error no lost task explained (only
        #: these count against the transient-retry budget: retries after a
        #: ps or worker loss do not).
        self.unexplained_failures = 0
        #: Failed attempts explained by another task being lost (bounded too).
        self.other_lost_failures = 0
        self.started_at = 0.0
        #: Whether `args`/`kwargs` hold per-worker values to resolve per worker.
        self.per_worker = False
        #: The worker running the current attempt (None while queued).
        self.worker: int | None = None
        #: What `fn` was traced from: after a ps task is rebuilt, `fn` is
        #: traced again from it.
        self.function: Any = None
        #: The tracer's generation `fn` was traced in (`psclient._coordinator.tracing`).
        self.generation = 0
        #: Whether the dispatcher copies the call's outputs into the future
        #: (False: made under `outputs_unread()`, the future gets None).
        self.copy_outputs = not _scheduling.outputs_unread

    @property
    def name(self) -> str:
        return self.future.name

    def __repr__(self) -> str:
        return f"<Closure #{self.id} {self.name!r} attempts={self.attempts}>"


def cancel_all(closures: list[Closure], why: str) -> None:
    """Cancel each closure's future (a running one gets CancelledError(`why`) instead)."""
    for closure in closures:
        future = closure.future
        if future.cancel():
            # cancel() alone leaves concurrent.futures.wait()/as_completed()
            # waiting for good: only set_running_or_notify_cancel() wakes them,
            # and it may run once (a second call raises).
            with future._condition:
                if future._state == "CANCELLED":
                    future.set_running_or_notify_cancel()
        else:
            # A retried closure is already RUNNING, which stdlib futures cannot
            # cancel; resolve it with the same exception type instead.
            closure.future.set_exception(concurrent.futures.CancelledError(why))
