"""The parts of a `ParameterServerStrategy`, built from its config in dependency order.

Each part is given what it needs when it is made; nothing is filled in
afterwards. TensorFlow's side (tracing, variables, per-worker values,
checkpoints, the edge) is made here, then the engine (`psclient._engine`:
dispatcher threads, probes, the recovery thread, elastic workers) around it:

    edge, roster, scheduler
    steps (scheduler) -> variable store (steps' renew) -> tracer (store, steps)
    per-worker registry, data ledgers (store), checkpoints (roster, for messages)
    engine (all of the above; retrace: the tracer by weak reference)

Nothing is connected or started here: the strategy does that once every
argument has passed.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import weakref

from psclient._cluster.spec import Cluster
from psclient._coordinator.checkpoints.checkpoint import Checkpoints
from psclient._coordinator.data.per_worker import resolve_per_worker
from psclient._coordinator.data.ledgers import Ledgers
from psclient._coordinator.stores import PerWorkerRegistry, VariableStore
from psclient._coordinator.training.sync import Steps
from psclient._coordinator.engine_edge import TFEdge
from psclient._coordinator.tracing import Tracer
from psclient._core.closure import Closure
from psclient._core.scheduler import Scheduler
from psclient._engine.assembly import Engine
from psclient._engine.config import StrategyConfig
from psclient._engine.edge import Roster, StrategyParts
from psclient._engine.recovery import RecoveryConfig

__all__ = ["Facades", "Parts", "assemble"]

log = logging.getLogger("psclient")


class Facades:
    """The TF API objects made for one strategy: its `ClusterCoordinator` (one per strategy, as TF's),
    held weakly (the coordinator holds the strategy)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.coordinator: weakref.ref = lambda: None  # type: ignore[assignment] - a dead reference


@dataclasses.dataclass(frozen=True)
class Parts:
    edge: TFEdge
    scheduler: Scheduler
    steps: Steps
    store: VariableStore
    tracer: Tracer
    per_worker: PerWorkerRegistry
    checkpoints: Checkpoints | None
    engine: Engine
    ledgers: Ledgers
    facades: Facades = dataclasses.field(default_factory=Facades)


def assemble(cluster: Cluster, config: StrategyConfig, *, checkpoint_dir: str | None, partitioner) -> Parts:
    """Every part of a strategy on `cluster` (`checkpoint_dir` and `partitioner`: the config's, made concrete).

    Each checkpoint carries the data ledgers (`Ledgers.meta` joins its layout), and a lost ps
    restored from one gives them back (`Ledgers.roll_back`)."""
    hang_timeout = config.hang_timeout
    edge = TFEdge(streaming_enqueue=config.streaming)
    roster = Roster(cluster)
    scheduler = Scheduler(cluster.num_workers)
    steps = Steps(scheduler, config.max_staleness, config.replicas_to_aggregate, timeout=hang_timeout,
                  measured=config.measured)
    deltas = config.delta_checkpoint_interval is not None or config.delta_checkpoint_every is not None
    # Write marks only where a checkpoint's cut uses them (each copied before its cut, full or delta).
    marks = checkpoint_dir is not None and config.checkpoint_cut == "rows"
    store = VariableStore(cluster.num_ps, partitioner, on_renew=(steps.renew,), write_marks=marks)
    tracer = Tracer(store.create, steps if config.measured else None, wait_for_run=config.streaming)
    per_worker = PerWorkerRegistry()
    ledgers = Ledgers(store)
    checkpoints = Checkpoints(
        checkpoint_dir, keep=config.checkpoints_to_keep, overwrite=config.overwrite_checkpoints,
        describe_ps=functools.partial(roster.address, "ps"), hang_timeout=hang_timeout,
        deltas=deltas,
    ) if checkpoint_dir is not None else None
    engine = Engine(
        roster, edge=edge, scheduler=scheduler,
        recovery_config=RecoveryConfig(
            checkpoint_interval=config.checkpoint_interval, checkpoint_every=config.checkpoint_every,
            delta_checkpoint_interval=config.delta_checkpoint_interval,
            delta_checkpoint_every=config.delta_checkpoint_every,
            hang_timeout=hang_timeout, worker_timeout=config.worker_timeout, ps_timeout=config.ps_timeout,
            probe_timeout=min(10.0, hang_timeout), interval=min(1.0, hang_timeout / 4),
            ps_recovery=config.recovery_mode,
        ),
        pipeline_depth=config.pipeline_depth, connect_timeout=config.connect_timeout,
        parts=StrategyParts(Prepare(tracer), store, per_worker, checkpoints, retrace=QueuedRetrace(tracer, scheduler),
                            checkpoint_meta=ledgers.meta, meta_restored=ledgers.roll_back,
                            renew_trace=RenewTrace(tracer)),
    )
    store.guard = engine.coordinator_access.run  # variables made on the coordinator, through a ps loss
    return Parts(edge, scheduler, steps, store, tracer, per_worker, checkpoints, engine, ledgers)


class RenewTrace:
    """`Tracer.renew` for a dispatcher, the tracer held weakly (as `QueuedRetrace` holds it)."""

    def __init__(self, tracer: Tracer):
        self._tracer = weakref.ref(tracer)

    def __call__(self, closure: Closure) -> bool:
        tracer = self._tracer()
        return tracer is not None and tracer.renew(closure)


class QueuedRetrace:
    """What the recovery thread calls after variables got new resources: trace what is queued again.

    Holds the tracer by weak reference: the tracer holds the user's functions,
    which may hold the strategy (a model holding the coordinator), and the
    recovery thread must not keep them alive.
    """

    def __init__(self, tracer: Tracer, scheduler: Scheduler):
        self._tracer = weakref.ref(tracer)
        self._scheduler = scheduler

    def __call__(self) -> None:
        tracer = self._tracer()
        if tracer is not None:  # None: the strategy is being collected
            tracer.retrace(self._scheduler.queued())


class Prepare:
    """What a dispatcher calls for a closure on a worker: (function, args, kwargs), per-worker
    values resolved, the trace current (`Tracer.current`). Holds the tracer weakly, as
    `QueuedRetrace` does."""

    def __init__(self, tracer: Tracer):
        self._tracer = weakref.ref(tracer)

    def __call__(self, closure: Closure, worker: int) -> tuple:
        tracer = self._tracer()
        if tracer is not None and tracer.current(closure):
            log.warning("%r reached worker %d with a trace made before a ps recovery (or before a function "
                        "was traced anew): traced again", closure, worker)
        if not closure.per_worker:
            return closure.fn, closure.args, closure.kwargs
        args, kwargs = resolve_per_worker(closure.args, closure.kwargs, worker)
        return closure.fn, args, kwargs
