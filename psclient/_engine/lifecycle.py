"""Taking a strategy down: undoing a half-made one, stopping a whole one.

The constructor registers these as undo steps and as the strategy's
finalizer (which runs on `shutdown()` or when a forgotten strategy is
collected), so they take the parts, never the strategy itself.
"""

from __future__ import annotations

import logging
from typing import Any

from psclient._engine import registry
from psclient._engine.dispatch import Dispatcher
from psclient._engine.edge import Edge
from psclient._engine.probes import FailureProbes
from psclient._engine.recovery import Recovery
from psclient._core.health import Prober
from psclient._core.scheduler import Scheduler

__all__ = ["leave", "shutdown_quietly", "stop_dispatch"]

log = logging.getLogger("psclient")


def leave(edge: Edge, strategy: Any) -> None:
    """Undo a constructor's connection: the next strategy can connect at once."""
    edge.disconnect()
    registry.release(strategy)


def stop_dispatch(scheduler: Scheduler, dispatcher: Dispatcher, timeout: float) -> None:
    scheduler.close()
    dispatcher.stop(timeout)


def shutdown_quietly(
    scheduler: Scheduler, dispatcher: Dispatcher, recovery: Recovery, prober: Prober, edge: Edge, timeout: float,
    probes: FailureProbes,
) -> None:
    stopped = recovery.stop(timeout)
    scheduler.close()
    stuck = dispatcher.stop(timeout)
    # The tasks may go away after this: leave TF's view of them, or every
    # later tf.function in this process (plain local Keras too) would fail.
    # Not while a task hangs: TF's update_server_def would wait on it forever
    # (a worker the recovery took for hung; a ps that leaves a probe unanswered:
    # a save given up on a SIGSTOPped ps held shutdown() until it answered);
    # nor while the recovery thread is still inside a TF call (it may hold
    # the connection lock).
    hung = recovery.hung_in_view() if stopped else []
    hung_ps = probes.hung_ps() if stopped and not hung else ()
    stuck += prober.close(min(timeout, 1.0))
    if not stopped:
        log.warning("shutdown: the recovery thread is still inside a TensorFlow call; TF's "
                    "view of the cluster is kept")
    elif hung:
        log.warning("shutdown: worker(s) %s hang; TF's view of the cluster is kept", hung)
    elif hung_ps:
        log.warning("shutdown: ps task(s) %s do not answer (hung?); TF's view of the cluster is kept",
                    list(hung_ps))
    else:
        edge.disconnect()
    if stuck:
        log.warning(
            "shutdown: %s still wait on a task that does not answer (hung?); they "
            "exit when it answers or dies", ", ".join(stuck),
        )
