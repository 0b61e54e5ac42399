"""Reads and writes of ps variables made on the coordinator, through a ps loss. Pure logic.

A scheduled closure whose ps goes away is run again once the recovery has
restored the ps (`psclient._core.failures`). psclient also touches ps state
from the coordinator itself, outside any closure: traces reading a dynamic
table, checkpoints, Keras's metric resets and reads, stats
(`psclient._coordinator.ps_state` lists them). A ps lost while nothing ran
fails the first of those with TF's error, and the user's training with it.
`through_ps_loss` runs such an access and, when it fails:

- classifies the error as a closure's is classified (`failures.classify`,
  the ps probed first; no worker is involved);
- a lost ps: reports it to the recovery (the event a closure's ps error
  posts), waits until the recovery has settled (restored the ps, or given
  up), then runs the access again; given up: `PSUnavailableError` chained
  to TF's error;
- a connection error while every ps answers: run again a few times after a
  growing pause (a channel to a task just back can fail for a moment);
- a tensor its task no longer finds (TF's "Unable to find the relevant
  tensor remote_handle") while TF's view of the cluster changed during the
  access: run again, at most MAX_STRADDLES times (in two seeded chaos plans a
  tensor made on a ps just before a reconnect was gone from it just after:
  a Keras metric's read, a probe's operand);
- any other error: the access's own, raised unchanged.

The TensorFlow side (what an op error is, the probes, the recovery's event
and wait) comes in as a `PsAccessEdge`, so this is testable without TF.

Who waits: only the outermost guarded access of a thread. An access made
inside another (a read at trace time, inside `schedule()`'s guarded trace)
runs plainly and its error goes to the outer one, which runs the whole
thing again once the recovery has settled: the outer one waits where it
holds none of psclient's locks (the tracer's lock, which the recovery's
retrace takes, is held only inside). psclient's own threads (the recovery
thread, the dispatcher threads) run inside `handled_elsewhere()`: their
failures are the closures' and the recovery's to handle, and a wait there
would wait on itself.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator, Protocol, TypeVar

from psclient._core.errors import PSUnavailableError, first_line
from psclient._core.failures import Verdict, classify, retry_pause, stale_remote_handle

__all__ = ["PsAccessEdge", "guarding", "handled_elsewhere", "through_ps_loss"]

T = TypeVar("T")

#: At most this many ps recoveries for one access: a ps that keeps dying under
#: the same read is past what waiting can fix.
MAX_PS_RECOVERIES = 3

#: At most this many runs again of one access that lost a tensor to a change of TF's view.
MAX_STRADDLES = 3

#: `depth` > 0 while this thread is inside a guarded access (or `handled_elsewhere`).
_inside = threading.local()


def guarding() -> bool:
    """Whether a ps loss met on this thread now is handled further out (module doc)."""
    return getattr(_inside, "depth", 0) > 0


@contextlib.contextmanager
def handled_elsewhere() -> Iterator[None]:
    """While inside: guarded accesses of this thread run plainly (a thread of psclient's own)."""
    _inside.depth = getattr(_inside, "depth", 0) + 1
    try:
        yield
    finally:
        _inside.depth -= 1


class PsAccessEdge(Protocol):
    def is_op_error(self, error: BaseException) -> bool:
        """Whether `error` is TF's, or raised from TF's (an access's own bug is raised unchanged)."""

    def lost_ps(self) -> tuple:
        """The ps tasks that do not answer or no longer hold their variables (probes)."""

    def ps_epoch(self) -> int:
        """The recovery's count of settled ps losses, read before probing."""

    def connection_changes(self) -> int:
        """How many changes of TF's view of the cluster began or ended in this process so far."""

    def report_lost(self, lost: tuple, epoch: int) -> None:
        """Tell the recovery these ps tasks are lost (as a failed closure does)."""

    def wait_settled(self, epoch: int, timeout: float) -> bool:
        """Wait until the recovery settled the loss seen at `epoch`; False on timeout."""

    def given_up(self) -> BaseException | None:
        """The recovery's error once it gave up on a lost ps (or stopped), else None."""

    def describe(self, lost: tuple) -> tuple[str, str | None]:
        """(task, address) of the first lost ps, for the error."""

    #: How long one recovery may take before the access gives up (the strategy's
    #: ps recovery limits: ps_timeout plus the wait for running closures).
    settle_timeout: float


def through_ps_loss(access: Callable[[], T], edge: PsAccessEdge, what: str,
                    sleep: Callable[[float], None], *, wait: bool = True) -> T:
    """`access()`, run again after a ps loss is recovered (module doc). `what` names it in errors.

    `wait=False`: a lost ps is reported to the recovery, not waited for: `PSUnavailableError`
    at once (a read of what is, `stats()`, must not hang for as long as a recovery takes).
    Inside another guarded access, or on a thread `handled_elsewhere`: `access()` as is.
    """
    if guarding():
        return access()
    unexplained = 0
    recoveries = 0
    straddles = 0
    while True:
        epoch = edge.ps_epoch()
        changes = edge.connection_changes()
        try:
            # Accesses nested in this one run plainly: their errors come here. (Inline, not
            # `handled_elsewhere()`: schedule() passes here at every call.)
            _inside.depth = 1
            try:
                return access()
            finally:
                _inside.depth = 0
        except Exception as error:
            if not edge.is_op_error(error):
                raise
            broken = edge.given_up()
            if broken is not None:
                raise _unavailable(edge, (), what, broken, error) from error
            if stale_remote_handle(error) and edge.connection_changes() != changes and straddles < MAX_STRADDLES:
                straddles += 1  # the tensor was lost to the change of TF's view: made again after it,
                sleep(retry_pause(Verdict.TRANSIENT, straddles))  # a change still under way given time to end
                continue
            lost: tuple = ()

            def ps_lost() -> bool:
                nonlocal lost
                lost = tuple(edge.lost_ps())
                return bool(lost)

            verdict = classify(error, lambda: True, ps_lost=ps_lost, attempts=unexplained + 1)
            if verdict is Verdict.PS_LOST:
                recoveries += 1
                if recoveries > MAX_PS_RECOVERIES:
                    raise _unavailable(edge, lost, what, f"lost again after {MAX_PS_RECOVERIES} recoveries",
                                       error) from error
                edge.report_lost(lost, epoch)
                if not wait:
                    raise _unavailable(edge, lost, what, "it is being recovered (not waited for)",
                                       error) from error
                if not edge.wait_settled(epoch, edge.settle_timeout):
                    raise _unavailable(edge, lost, what, f"not recovered within {edge.settle_timeout:g} s",
                                       error) from error
                broken = edge.given_up()
                if broken is not None:
                    raise _unavailable(edge, lost, what, broken, error) from error
                continue
            if verdict is Verdict.TRANSIENT:
                unexplained += 1
                sleep(retry_pause(verdict, unexplained))  # the channel needs the time
                continue
            raise


def _unavailable(edge: PsAccessEdge, lost: tuple, what: str, why, error: BaseException) -> PSUnavailableError:
    task, address = edge.describe(lost)
    reason = first_line(why) if isinstance(why, BaseException) else why
    # TF's error named in the message too: Keras's traceback filter drops the chain.
    return PSUnavailableError(
        f"{what} on the coordinator failed: parameter server task {task} ({address}) was lost and "
        f"the strategy could not restore it: {reason} (TF's error: {type(error).__name__}: "
        f"{first_line(error)[:300]})", task=task, address=address,
    )
