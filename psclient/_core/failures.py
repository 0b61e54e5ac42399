"""Failure policy: what to do when a closure raises. Pure logic.

TF's coordinator decides by matching substrings of error messages. psclient
decides by the error's *type* and by *probing* the task the closure ran on:

- an error type that a lost connection produces (Unavailable, Aborted,
  Cancelled, DeadlineExceeded, and Internal/Unknown errors from a broken
  channel) is only a *candidate* infrastructure failure;
- the probes settle it: if a ps task does not answer, the variables may be
  lost: the closure is retried once the strategy has recovered the ps (or
  fails with PSUnavailableError if it cannot);
- if the worker does not answer, the closure is retried on another worker
  and the worker is taken out of rotation;
- if the worker answers but another task of the cluster does not, the error
  came from that task (TF's eager runtime can fail a call on one worker
  because another worker died), so the closure is retried;
- a candidate while every task answers is retried a few times, with a
  growing pause (a gRPC channel to a task that just restarted can fail for a
  moment); if it keeps failing, or for any other error, it is the function's
  own error and goes to its future.

The probes are passed in as callables so the policy is testable without TF.
What a verdict means for the *task* (take a worker out, recover a ps) is the
recovery state machine's decision (`psclient._core.recovery_machine`); this module
only decides what happens to the failed *call*.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Callable

__all__ = [
    "Verdict", "classify", "retry_pause", "iterator_cancelled", "stale_remote_handle", "stale_worker_context",
    "unknown_own_device", "CONNECTION_ERROR_NAMES",
    "MAX_TRANSIENT_ATTEMPTS", "AfterFailure", "after_failure",
]

#: TF error class names that a lost or broken connection can produce.
CONNECTION_ERROR_NAMES = frozenset(
    {
        "UnavailableError",
        "AbortedError",
        "CancelledError",
        "DeadlineExceededError",
        "InternalError",
        "UnknownError",
    }
)


class Verdict(enum.Enum):
    #: The function itself failed: resolve its future with the error.
    FUNCTION_ERROR = "function_error"
    #: The worker is gone: run the closure elsewhere, take the worker out.
    WORKER_LOST = "worker_lost"
    #: A ps task is gone: recover it (or give up), then run the closure again.
    PS_LOST = "ps_lost"
    #: Another task is gone and broke this call: run the closure again.
    OTHER_TASK_LOST = "other_task_lost"
    #: A connection error while every task answers: run it again, a few times
    #: (a channel can still be reconnecting right after a task restarted).
    TRANSIENT = "transient"

#: How many attempts a closure gets when its connection errors have no lost
#: task to explain them; after that the error is the function's own.
MAX_TRANSIENT_ATTEMPTS = 4
#: How many times one closure is run again because *another* task is lost.
#: A worker that broke the call is taken out at once and a rerun succeeds;
#: one that keeps failing while a worker stays away (a function whose own
#: error has a connection-type code, such as a py_function's UnknownError)
#: would otherwise run for good. Then the usual few unexplained attempts follow.
MAX_OTHER_LOST_ATTEMPTS = 8


def is_connection_error_type(error: BaseException) -> bool:
    return any(cls.__name__ in CONNECTION_ERROR_NAMES for cls in type(error).__mro__)


def classify(
    error: BaseException,
    worker_answers: Callable[[], bool],
    others_lost: Callable[[], bool] = lambda: False,
    ps_lost: Callable[[], bool] = lambda: False,
    attempts: int = MAX_TRANSIENT_ATTEMPTS,
    other_lost_attempts: int = 1,
    worker_device: str | None = None,
) -> Verdict:
    """Decide what a closure's error means.

    `ps_lost` probes the ps tasks; `worker_answers` the closure's worker;
    `others_lost` the other workers (and takes lost ones out of rotation).
    Probes run for connection-type errors, in that order, each only if the
    one before found nothing; any other error probes the ps tasks only. `attempts` is how many of the closure's
    attempts, this one included, failed with a connection error that no
    probe explained (retries after a lost task do not count): such an error
    is retried until MAX_TRANSIENT_ATTEMPTS, then it is the function's own.
    `other_lost_attempts`: this one included, how many failed while another
    task was lost; past MAX_OTHER_LOST_ATTEMPTS that no longer explains it.
    `worker_device`: the closure's worker ("/job:worker/replica:0/task:N"), for `stale_worker_context`.
    """
    if not is_connection_error_type(error):
        # A ps restarted behind the coordinator's back (noticed by no call
        # while it was away) fails reads of its variables with
        # InvalidArgumentError ("invalid device"), not a connection error:
        # the ps probe (which checks the variables' handles) tells it apart
        # from the function's own error.
        if ps_lost():
            return Verdict.PS_LOST
        if stale_worker_context(error, worker_device) and attempts < MAX_TRANSIENT_ATTEMPTS:
            return Verdict.WORKER_LOST
        return Verdict.FUNCTION_ERROR
    # The ps tasks first: a lost ps breaks calls on every worker, and can make
    # a worker's own probe fail too, which must not take healthy workers out.
    if ps_lost():
        return Verdict.PS_LOST
    if not worker_answers():
        return Verdict.WORKER_LOST
    if others_lost() and other_lost_attempts <= MAX_OTHER_LOST_ATTEMPTS:
        return Verdict.OTHER_TASK_LOST
    if attempts < MAX_TRANSIENT_ATTEMPTS:
        return Verdict.TRANSIENT
    return Verdict.FUNCTION_ERROR


def stale_remote_handle(error: BaseException) -> bool:
    """Whether `error` says the worker no longer holds a tensor the call named (TF's
    InvalidArgumentError "Unable to find the relevant tensor remote_handle").

    A worker restarted behind the coordinator's back while a ps was lost: its first
    call failed as the ps loss (the ps probe comes first), the ps recovery's reconnect
    made the worker's context again, and the call's per-worker resources (a dataset
    iterator) named tensors of the old one. Taken for lost, the worker rejoins with
    its resources made again. TF says it in the message only; a call that still
    fails so after MAX_TRANSIENT_ATTEMPTS is the function's own error.
    """
    if not any(cls.__name__ == "InvalidArgumentError" for cls in type(error).__mro__):
        return False
    return "Unable to find the relevant tensor remote_handle" in str(error)


def unknown_own_device(error: BaseException, worker_device: str | None) -> bool:
    """Whether `error` is TF's InvalidArgumentError "<the worker's own device> unknown device".

    A worker restarted while the ps tasks hung: no reconnect could introduce its new process
    (TF's reconnect waits on every task), its probe answers, and each call the coordinator
    made there named a device the new process did not know. The closure went back to it,
    taken for the ps loss while a ps was out, then failed as the function's own error once
    the ps were back (a seeded chaos plan: two ps hung, a worker killed meanwhile).
    """
    if worker_device is None or not any(cls.__name__ == "InvalidArgumentError" for cls in type(error).__mro__):
        return False
    message = str(error)
    return f"{worker_device}/device:" in message and "unknown device" in message


def stale_worker_context(error: BaseException, worker_device: str | None = None) -> bool:
    """Whether `error` says the worker does not hold the coordinator's context as it was: a tensor
    of an older context (`stale_remote_handle`), or its own device unknown (`unknown_own_device`).
    Either is taken for the worker's loss (it rejoins with its context and resources made again),
    a bounded number of times a closure: a function can fail so on its own."""
    return stale_remote_handle(error) or unknown_own_device(error, worker_device)


def iterator_cancelled(error: BaseException) -> bool:
    """Whether `error` is a dataset iterator op that was cancelled.

    A tf.data iterator whose GetNext was cancelled mid-way (its step aborted
    because a ps task went away under it) can stay cancelled: every later
    GetNext on it fails the same way although every task answers. Retrying
    cannot help; the worker's iterators must be made again. TF names the op
    in the message (`[[{{node IteratorGetNext}}]]`).
    """
    if not any(cls.__name__ == "CancelledError" for cls in type(error).__mro__):
        return False
    return "Iterator" in str(error)


def end_of_sequence(error: BaseException) -> bool:
    """Whether `error` is TF's OutOfRangeError: a dataset iterator reached its end."""
    return any(cls.__name__ == "OutOfRangeError" for cls in type(error).__mro__)


def retry_pause(verdict: Verdict, attempts: int) -> float:
    """Seconds to wait before a retried call runs again: a growing pause for
    TRANSIENT (the channel needs the time) and for OTHER_TASK_LOST after its
    first retry (the recovery thread needs the time to take the task out),
    none otherwise."""
    if verdict is Verdict.TRANSIENT:
        return min(2.0, 0.5 * 2 ** (attempts - 1))
    if verdict is Verdict.OTHER_TASK_LOST and attempts > 1:
        return min(2.0, 0.1 * 2 ** (attempts - 2))
    return 0.0


@dataclasses.dataclass(frozen=True)
class AfterFailure:
    """What a dispatcher thread does with a closure whose call failed (`after_failure`)."""

    #: Queued again; else the (named) error goes to its future.
    retry: bool
    #: Added to the closure's unexplained / other-task-lost failure counts.
    unexplained: int = 0
    other_lost: int = 0
    #: Seconds this worker's thread waits before queueing it again (the channel needs the time).
    pause: float = 0.0
    #: Make this worker's dataset iterators again first.
    renew_iterators: bool = False


def after_failure(verdict: Verdict, *, unexplained_failures: int, other_lost_failures: int,
                  broken_iterator: bool) -> AfterFailure:
    """The decision for a failed call whose worker still answers (WORKER_LOST is the recovery's).

    `broken_iterator`: for FUNCTION_ERROR, the end of a dataset that never ends
    (its iterator broke when a call was cancelled while its repeat() began a
    pass); for TRANSIENT, a cancelled iterator. Either fails the same way again
    on the same iterators, so they are made again and the call retried at once.
    The counts are the closure's before this failure.
    """
    if verdict is Verdict.FUNCTION_ERROR:
        return AfterFailure(True, unexplained=1, renew_iterators=True) if broken_iterator else AfterFailure(False)
    if verdict is Verdict.OTHER_TASK_LOST:
        return AfterFailure(True, other_lost=1, pause=retry_pause(verdict, other_lost_failures + 1))
    if verdict is Verdict.TRANSIENT:
        if broken_iterator:
            return AfterFailure(True, unexplained=1, renew_iterators=True)
        return AfterFailure(True, unexplained=1, pause=retry_pause(verdict, unexplained_failures + 1))
    return AfterFailure(True)  # PS_LOST: queued while the recovery holds the queue
