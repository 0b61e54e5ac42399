"""The vocabulary of the recovery state machine (`psclient._core.recovery_machine`).

`TaskState` is what a task is in; events are what the machine is told (by
the recovery thread's rounds, by dispatcher threads, by callers); actions are
what it asks the recovery thread to do. All are plain immutable values. The
machine handles each event type and each operation's `Done` with a handler of
its own (dispatched by type).

States of a task (`TaskState`):

    worker:  UP -> SUSPECT (a call failed, its probe did not answer: taken out)
             UP -> HUNG (heartbeat probe overdue for hang_timeout: taken out)
             SUSPECT/HUNG -> LOST (TCP connect refused: the process is gone)
             SUSPECT/LOST -> HUNG (TCP accepted or silent, its probe still waits)
             any out -> REJOINING (answers again; reconnect, check, rebuild)
             REJOINING -> UP (rebuilt) or SUSPECT (a step failed; tried again)
    ps:      UP -> LOST (does not answer) -> RECOVERING (accepts connections again)
             RECOVERING -> UP (variables renewed, restored, functions retraced)

Events in                                 | actions out
------------------------------------------|------------------------------------------
Tick(running, completed) every round      | FailAll(workers) when none UP for worker_timeout;
                                          | starts what is due (the machine's flows)
ProbeOverdue(worker, waited) of an UP one | >= hang_timeout: TakeOut, HUNG
WorkerNotAnswering(worker) (dispatcher,   | TakeOut, SUSPECT
  or a failed heartbeat, port refused)    |
WorkerSeen(worker, tcp, probe_pending)    | a worker that is out: LOST / HUNG / answers
                                          | again (a rejoin candidate)
PsNotAnswering(ps) (dispatcher)           | PsFailed, PauseDispatch; without a checkpoint
                                          | FailAll(ps, permanent)
PsSeen(ps, tcp)                           | OPEN: RECOVERING
CheckpointRequested(ticket, reason)       | queued; Finish(ticket, ...) when written
CheckpointWritten(path, completed, error) | the background write ended: Finish its requests
CheckpointCopied(copy) (the copy's thread)| the copy before the cut ended: the pause may come
Restored()                                | a checkpoint exists from now on
Done(op, ok, value, error)                | the next step of the flow that started op
WorkerAdded(worker, ticket)               | a rejoin candidate; Finish(ticket) once up
WorkerRetired(worker, ticket)             | out of every Reconnect; RETIRED and
                                          | Finish(ticket) once out of TF's view
                                          | (both: joining.py)
Shutdown()                                | Finish every waiting ticket; nothing after

`Drained()` (a dispatcher) is the recovery thread's, not the machine's: the last
closure running under a paused dispatch ended, so a checkpoint waiting for that
gets its round (its Tick) now instead of at the next round.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from psclient._core.tcp_state import TcpState


class TaskState(enum.Enum):
    #: Takes work (worker) / serves its variables (ps).
    UP = "up"
    #: Worker: a call on it failed and its probe did not answer; taken out, not yet known hung or gone.
    SUSPECT = "suspect"
    #: Worker: taken out; its process is there (TCP accepted or silent) but does not answer.
    HUNG = "hung"
    #: Worker: its process is gone (TCP refused). Ps: does not answer; waiting for it.
    LOST = "lost"
    #: Worker: answers again; being reconnected, checked and rebuilt.
    REJOINING = "rejoining"
    #: Ps: accepts connections again; its variables are being renewed and restored.
    RECOVERING = "recovering"
    #: Worker: removed from the strategy (`remove_worker`) and out of TF's view; never probed.
    RETIRED = "retired"


# ---------------------------------------------------------------- events
@dataclasses.dataclass(frozen=True)
class Tick:
    running: int
    completed: int


@dataclasses.dataclass(frozen=True)
class Drained:
    """No closure runs any more under a paused dispatch (see the module's docstring)."""


@dataclasses.dataclass(frozen=True)
class ProbeOverdue:
    worker: int
    waited: float


@dataclasses.dataclass(frozen=True)
class WorkerNotAnswering:
    worker: int
    detected_after: float | None = None
    epoch: int = 0


@dataclasses.dataclass(frozen=True)
class WorkerSeen:
    worker: int
    tcp: TcpState  # OPEN, CLOSED (refused: gone) or SILENT (no answer at all)
    probe_pending: bool


@dataclasses.dataclass(frozen=True)
class PsNotAnswering:
    ps: tuple
    epoch: int = 0


@dataclasses.dataclass(frozen=True)
class PsSeen:
    ps: int
    tcp: str


@dataclasses.dataclass(frozen=True)
class CheckpointRequested:
    ticket: Any
    reason: str


@dataclasses.dataclass(frozen=True)
class CheckpointWritten:
    """The background write of the checkpoint a `Checkpoint` took ended: `path`, or `error`."""
    path: str | None
    completed: int | None
    error: BaseException | None = None


@dataclasses.dataclass(frozen=True)
class CheckpointCopied:
    """The copy `CopyForCheckpoint(copy)` started ended (copied, or given up: the cut then
    reads the variables whole). `error`: given up on a ps that did not answer within
    `hang_timeout`; the checkpoint fails with it, without a cut."""
    copy: int
    error: BaseException | None = None


@dataclasses.dataclass(frozen=True)
class Restored:
    pass


@dataclasses.dataclass(frozen=True)
class WorkerAdded:
    """A worker joins (a new slot, or a retired one at the same address again); `ticket`
    is finished with its index once it takes work."""
    worker: int
    ticket: Any


@dataclasses.dataclass(frozen=True)
class WorkerRetired:
    """A worker leaves for good (the scheduler already gives it nothing); `ticket` is
    finished once it is out of TF's view."""
    worker: int
    ticket: Any


@dataclasses.dataclass(frozen=True)
class Done:
    op: Any
    ok: bool
    value: Any = None
    error: Any = None


@dataclasses.dataclass(frozen=True)
class Shutdown:
    pass


# --------------------------------------------------------------- actions
@dataclasses.dataclass(frozen=True)
class TakeOut:
    """Take the worker out of rotation and requeue the closures running on it."""
    worker: int
    detected_after: float | None = None
    why: str = ""


@dataclasses.dataclass(frozen=True)
class Reconnect:
    """Operation: point TF's view at the ps tasks and `workers` (one of the three kinds
    below). `returning` cannot be probed before; every other worker named must answer
    first, else Done(ok=False, value={worker: tcp state}) names those that did not. So
    must each worker of `leaving` (retired, dropped from the view by this Reconnect) whose
    port does not refuse: TF's `update_server_def` waits for good on a dropped task that hangs."""
    workers: frozenset
    leaving: frozenset = dataclasses.field(default=frozenset(), kw_only=True)
    #: The worker coming back (`RejoinWorker` only).
    returning = None


@dataclasses.dataclass(frozen=True)
class DropWorkers(Reconnect):
    """Reconnect to the workers that take work: gone ones leave TF's view."""


@dataclasses.dataclass(frozen=True)
class RejoinWorker(Reconnect):
    """Reconnect to the workers that take work and `returning`, which answers again."""
    returning: int


@dataclasses.dataclass(frozen=True)
class ReconnectPs(Reconnect):
    """Reconnect once every lost ps accepts connections again (a ps recovery's first step)."""


@dataclasses.dataclass(frozen=True)
class CheckAnswers:
    """Operation: the worker answers a probe."""
    worker: int


@dataclasses.dataclass(frozen=True)
class RebuildWorker:
    """Operation: build the worker's per-worker datasets and resources again."""
    worker: int


@dataclasses.dataclass(frozen=True)
class BringUp:
    worker: int
    recovered_after: float
    #: A new worker's first (not a rejoin).
    joined: bool = False


@dataclasses.dataclass(frozen=True)
class PauseDispatch:
    reason: str


@dataclasses.dataclass(frozen=True)
class ResumeDispatch:
    reason: str


@dataclasses.dataclass(frozen=True)
class RequeueRunning:
    """Abandon every running attempt and queue those closures again."""


@dataclasses.dataclass(frozen=True)
class PsFailed:
    ps: int


@dataclasses.dataclass(frozen=True)
class RenewAndRestore:
    """Operation: new resources for the variables of `lost`; restored from the newest
    checkpoint: those of `lost` only (`mode` "part") or every variable ("all")."""
    lost: tuple
    mode: str = "all"


@dataclasses.dataclass(frozen=True)
class Retrace:
    """Operation: trace the queued closures' functions again (new variable resources)."""


@dataclasses.dataclass(frozen=True)
class RebuildResources:
    """Operation: rebuild every worker's per-worker resources (not datasets)."""


@dataclasses.dataclass(frozen=True)
class PsRecovered:
    lost: tuple
    back_at: float


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """Operation: take a checkpoint's snapshot (dispatch is paused and idle) and start its
    background write, which ends with `CheckpointWritten`. Done.value: completed closures."""
    reason: str


@dataclasses.dataclass(frozen=True)
class CopyForCheckpoint:
    """Start copying the big variables on their ps before the checkpoint's cut, in a thread of
    its own while training and recovery go on; it ends with `CheckpointCopied(copy)`."""
    copy: int


@dataclasses.dataclass(frozen=True)
class StopCopy:
    """Stop the copy under way (if any), wait for its thread and drop what it copied: a ps
    recovery is about to renew the variables it read."""


@dataclasses.dataclass(frozen=True)
class FailAll:
    """Fail every queued and running closure. kind "workers": waited seconds without any
    worker; kind "ps": `lost` cannot be recovered (`why`); permanent: schedule raises it too."""
    kind: str
    waited: float = 0.0
    lost: tuple = ()
    why: str = ""
    permanent: bool = False
    first: bool = True


@dataclasses.dataclass(frozen=True)
class Finish:
    """Answer a waiting caller: `value`, or raise `error`."""
    ticket: Any
    value: Any = None
    error: Any = None


OPERATIONS = (Reconnect, CheckAnswers, RebuildWorker, RenewAndRestore, Retrace, RebuildResources, Checkpoint)
