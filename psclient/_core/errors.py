"""The few exceptions psclient raises.

Each has one meaning. Errors raised *by a scheduled function* are re-raised with
their own type (a `tf.errors.InvalidArgumentError` stays one); these classes are
for what goes wrong around the function: the cluster, the configuration, or
the strategy's own life cycle.
"""


class PSClientError(Exception):
    """Base class of every psclient-specific error."""


class ClusterConfigError(PSClientError, ValueError):
    """A cluster description (dict, ClusterSpec, resolver, TF_CONFIG) is malformed."""


class TaskUnreachableError(PSClientError, ConnectionError):
    """A task of the cluster did not answer in time. Names the task and its address."""

    def __init__(self, message, *, task=None, address=None):
        super().__init__(message)
        self.task = task
        self.address = address


class WorkerUnavailableError(TaskUnreachableError):
    """No worker could run a closure: every worker is gone (after the configured wait)."""


class PSUnavailableError(TaskUnreachableError):
    """A parameter-server task was lost and the strategy cannot recover its variables."""


class CheckpointUnreadable(PSClientError, OSError):
    """A checkpoint cannot be read (half-written, damaged, or deleted); names what was tried and why.

    Raised by `strategy.restore()` (each checkpoint tried, the ps task and the
    file) and by the sidecar evaluator. `CheckpointUnreadableError` is the same class.
    """


CheckpointUnreadableError = CheckpointUnreadable


class StrategyClosedError(PSClientError, RuntimeError):
    """The strategy was shut down; it accepts no more work."""


class PsTimeout(Exception):
    """A ps did not answer within the time given (`checkpoint_parts.on_each_ps`); `_psclient_ps`
    names it. Internal: the errors users see carry it as their cause."""


def hung_ps_of(error: BaseException | None) -> int | None:
    """The ps a failed call gave up on because it did not answer (a PsTimeout in `error`'s causes)."""
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, PsTimeout):
            return getattr(error, "_psclient_ps", None)
        error, seen = error.__cause__, seen + 1
    return None


class StrategyAPIUnsupportedError(PSClientError, NotImplementedError, AttributeError):
    """A `tf.distribute.Strategy` method psclient does not offer; the message names psclient's way.

    An `AttributeError` too, so `hasattr(strategy, name)` is False, as for any
    attribute an object does not have.
    """


def first_line(error: BaseException) -> str:
    """The first line of an error's message (TF's run to many lines), for messages and logs."""
    text = str(getattr(error, "message", None) or error).strip()
    return text.splitlines()[0] if text else type(error).__name__
