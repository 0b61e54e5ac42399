"""How the recovery thread ends what it cannot save: the error every pending closure gets when the
machine fails all work (`FailAll`), and a caller's ticket answered (`Finish`)."""

from __future__ import annotations

import logging
from typing import Any

from psclient._core import recovery_messages as rm
from psclient._core.errors import PSUnavailableError, WorkerUnavailableError

__all__ = ["finish", "unavailable_error"]

log = logging.getLogger("psclient")


def unavailable_error(action: rm.FailAll, cluster: Any, worker_timeout: float) -> BaseException:
    """The error for `action`: every worker gone for `worker_timeout`, or a ps lost for good (logged)."""
    if action.kind == "workers":
        if action.first:
            log.error("every worker has been unavailable for %.0f s (worker_timeout=%g s): "
                      "failing pending work", action.waited, worker_timeout)
        return WorkerUnavailableError(
            f"No worker has been available for {action.waited:.0f} s (worker_timeout="
            f"{worker_timeout:g} s): every worker of the cluster is gone "
            f"({', '.join(cluster.workers)}). Pending scheduled functions "
            "failed; restart the workers, then schedule again.",
            task="worker", address=None,
        )
    lost = action.lost
    names = ", ".join(f"ps:{ps} at {cluster.address('ps', ps)}" for ps in lost)
    error = PSUnavailableError(
        f"Parameter server task {names} was lost and its variables cannot be recovered: "
        f"{action.why}. Pass checkpoint_dir= to ParameterServerStrategy to survive ps restarts.",
        task=f"ps:{lost[0]}", address=cluster.address("ps", lost[0]),
    )
    log.error("%s", error)
    return error


def finish(action: rm.Finish) -> None:
    """Answer a caller's ticket (a checkpoint, a worker added or retired), once."""
    ticket = action.ticket
    if ticket.done():
        return
    if action.error is not None:
        ticket.set_exception(action.error)
    else:
        ticket.set_result(action.value)
