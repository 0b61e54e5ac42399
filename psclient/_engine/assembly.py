"""`Engine`: the orchestration of one strategy, built in dependency order.

Each part gets what it needs when it is made, and nothing is filled in
later. The order breaks the one cycle of the graph (the dispatcher reports
to the recovery thread, which cancels the dispatcher's calls): the inbox
both post to is made first.

    roster, scheduler (given)
    prober, published view -> failure probes
    inbox -> dispatcher (prepare, probes, inbox) -> recovery (..., the dispatcher's cancel_calls)
    elastic workers (roster, scheduler, dispatcher, recovery)

Nothing starts until `start()`: a constructor that fails after building it
(a connect refused, say) has no thread to stop.
"""

from __future__ import annotations

import queue
import time
from typing import Callable

from psclient._core.health import Prober
from psclient._core.scheduler import Scheduler
from psclient._engine.coordinator_access import CoordinatorAccess
from psclient._engine.dispatch import Dispatcher
from psclient._engine.edge import Edge, Roster, StrategyParts
from psclient._engine.elastic import Elastic
from psclient._engine.probes import FailureProbes, Published
from psclient._engine.recovery import Recovery, RecoveryConfig, Wiring

__all__ = ["Engine"]


class Engine:
    """Dispatcher threads, failure probes, the recovery thread and elastic workers of one strategy."""

    def __init__(
        self,
        roster: Roster,
        *,
        edge: Edge,
        scheduler: Scheduler,
        recovery_config: RecoveryConfig,
        pipeline_depth: int,
        connect_timeout: float,
        parts: StrategyParts,
        clock: Callable[[], float] = time.monotonic,
    ):
        num_workers = roster.cluster.num_workers
        hang_timeout = recovery_config.hang_timeout
        self.edge = edge
        self.roster = roster
        self.scheduler = scheduler
        self.prober = Prober(edge.probe)
        #: What the recovery thread last decided (the view, the ps tasks lost), for readers on other threads.
        self.published = published = Published(num_workers)
        self.probes = FailureProbes(roster, self.prober, scheduler, published, recovery_config.probe_timeout,
                                    edge, held=parts.store.one_per_ps)
        inbox: queue.Queue = queue.Queue()  # what the dispatcher and callers report to the recovery thread
        self.dispatcher = Dispatcher(
            scheduler, num_workers=num_workers, pipeline_depth=pipeline_depth, prepare=parts.prepare,
            probes=self.probes, report=inbox.put, release_timeout=hang_timeout, iterators=parts.per_worker, edge=edge,
            renew_trace=parts.renew_trace,
        )
        self.recovery = Recovery(
            recovery_config, roster=roster, scheduler=scheduler, edge=edge, parts=parts,
            wiring=Wiring(self.prober, self.probes, published, inbox, self.dispatcher.cancel_calls), clock=clock,
        )
        self.coordinator_access = CoordinatorAccess(self.recovery, edge, roster)
        self.elastic = Elastic(roster, scheduler=scheduler, dispatcher=self.dispatcher, recovery=self.recovery,
                               edge=edge, connect_timeout=connect_timeout, hang_timeout=hang_timeout)

    def start_dispatch(self) -> None:
        """The dispatcher threads (they wait in the scheduler for work)."""
        self.dispatcher.start()

    def start_recovery(self) -> None:
        """The recovery thread: heartbeat probes, failures, rejoins, checkpoints."""
        self.recovery.start()
