"""`ParameterServerStrategy`: variables on ps tasks, closures on any free worker."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
import weakref
from collections.abc import Mapping
from typing import Any, Callable

import tensorflow as tf

from psclient._cluster.spec import Cluster
from psclient._engine import lifecycle, registry
from psclient._coordinator import runtime as _runtime
from psclient._coordinator.checkpoints.checkpoint import check_directory
from psclient._coordinator.data.datasets import (
    check_distributable,
    check_not_in_function,
    dataset_in_trace,
    inside_per_worker_dataset_fn,
    per_worker_datasets,
)
from psclient._coordinator.data.per_worker import (
    PerWorker,
    PerWorkerDataset,
    per_worker_resource,
)
from psclient._coordinator.data.shard_feed import LEDGERS_KEY
from psclient._coordinator.parts import Parts, assemble
from psclient._coordinator.scrapes import ScrapeSource
from psclient._coordinator.tables.table_stats import TableStatsReader
from psclient._coordinator.variables.sharding import partitioner_argument
from psclient._coordinator.tf_api import TFStrategyAPI, refuse_input_options
from psclient._coordinator.training.updates import place_updates_on_ps
from psclient._core.checks import check_positive
from psclient._engine.config import StrategyConfig, with_overrides
from psclient._core.metrics import MetricsServer
from psclient._core.errors import StrategyClosedError
from psclient._core.future import Future

__all__ = ["ParameterServerStrategy"]

log = logging.getLogger("psclient")

class ParameterServerStrategy(TFStrategyAPI):
    """Train with variables on parameter servers and steps on workers.

    Args:
      cluster: a `psclient.Cluster`, a dict of jobs, a `tf.train.ClusterSpec`
        or a TF cluster resolver; must have "worker" and "ps" jobs. An
        "evaluator" job is ignored (TF hangs when it is in the training spec).
      config: a `psclient.StrategyConfig` holding the arguments below (checked
        when it is made). Keyword arguments given beside it replace its
        fields; `strategy.config` is the result. An unknown keyword argument
        raises TypeError naming it.
      pipeline_depth: closures in flight per worker (>= 1). With 1, each
        worker runs one call at a time and errors surface at the call; more
        lets the next call travel while one runs. `benchmarks/dispatch.py`
        measures the difference on your machine.
      connect_timeout: seconds to wait for every task to accept connections
        before raising `TaskUnreachableError` naming the task and address.
      checkpoint_dir: where the strategy checkpoints every variable created
        in `scope()` by itself. Needed to survive a ps task's restart (without
        it a lost ps raises `PSUnavailableError`) and to resume with
        `restore()` after the coordinator restarts. A checkpoint is taken
        before the first scheduled function after variables are created,
        then every `checkpoint_interval` seconds and/or every `checkpoint_every`
        completed functions, keeping the newest `checkpoints_to_keep`; between
        them, with `delta_checkpoint_interval`/`_every`, deltas of the changed
        rows only; `checkpoint_cut` ("rows"/"copy"): how a cut reads embedding tables
        (docs/fault_tolerance.md). Checkpoints already in the directory are another run's: the
        first save raises FileExistsError unless `restore()` resumed from them or `overwrite_checkpoints=True`.
      overwrite_checkpoints: start over in a `checkpoint_dir` that holds
        another run's checkpoints: they are never restored, and are deleted
        as this run's are written (keeping `checkpoints_to_keep` in all).
      hang_timeout: a worker that does not answer a probe for this many
        seconds is treated as failed; its closures run elsewhere.
      worker_timeout: with every worker gone this long, pending and new
        work fails with `WorkerUnavailableError` instead of waiting.
      ps_timeout, ps_recovery: how long to wait for a lost ps to come back (with a `checkpoint_dir`)
        before `PSUnavailableError`; then "part": it alone goes back to the newest checkpoint, "all": every ps.
      variable_partitioner: how variables are split into shards along axis 0,
        one shard per ps task. "auto" (the default): TF's
        `tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=128 << 10, max_shards=num_ps)`, so variables of at
        most 128 KiB stay whole and larger ones are split over up to
        `num_ps` tasks (with one ps task nothing is split). None: every
        variable whole on one ps task. Or any callable `(shape, dtype) ->
        shards per axis` (TF's `MinSizePartitioner`, `MaxSizePartitioner`,
        `FixedShardsPartitioner`...). Shards sit on consecutive ps tasks;
        scalars and single-row variables are never offered to it. See
        docs/data_path.md (and what the default costs on one machine).
      max_staleness, replicas_to_aggregate: bounded-staleness and synchronous
        training (None, the defaults: asynchronous); docs/staleness.md. measure_staleness: True to measure the
        staleness of asynchronous updates (`stats()["staleness"]`; it costs
        CPU per step); None (default) measures only with either of the two.
      metrics_port: serve Prometheus metrics on this port of every interface (0: any free
        one, see `metrics_port`); None (default) serves none. docs/metrics.md lists them.

    Only one strategy may be connected per process at a time (TF's eager
    context is global); `shutdown()` one before creating the next. The rest
    of `tf.distribute.Strategy`'s surface: `psclient._coordinator.tf_api`.
    """

    def __init__(self, cluster: Any, config: StrategyConfig | None = None, **overrides: Any):
        config = with_overrides(config, overrides)
        cluster = Cluster.coerce(cluster)
        config.check_for(cluster.num_workers)
        self._config = config
        pipeline_depth, connect_timeout, hang_timeout = config.pipeline_depth, config.connect_timeout, config.hang_timeout
        variable_partitioner = partitioner_argument(config.variable_partitioner, cluster.num_ps)
        checkpoint_dir = config.checkpoint_dir
        if checkpoint_dir is not None:
            checkpoint_dir = check_directory(checkpoint_dir)  # a regular file fails before connecting
        _runtime.wait_reachable(cluster, connect_timeout)
        self._closed, self._shutdown_lock = False, threading.Lock()
        self._pipeline_depth, self._hang_timeout = pipeline_depth, hang_timeout
        self._variable_partitioner = variable_partitioner
        # The parts, each given what it needs as it is made (parts.py); `parts` for psclient's own modules.
        self._parts = parts = assemble(cluster, config, checkpoint_dir=checkpoint_dir, partitioner=variable_partitioner)
        edge, scheduler, engine, checkpoints = parts.edge, parts.scheduler, parts.engine, parts.checkpoints
        self._scheduler, self._steps, self._store = scheduler, parts.steps, parts.store
        self._tracer, self._per_worker = parts.tracer, parts.per_worker
        self._elastic, self._dispatcher, self._recovery = engine.elastic, engine.dispatcher, engine.recovery
        self._published = engine.published  # what the recovery thread last decided: the view, the ps lost
        # psclient's own reads and writes of ps state on the coordinator (traces, checkpoints,
        # Keras's metrics, dynamic tables), through a ps loss (psclient._coordinator.ps_state).
        self._coordinator_access = engine.coordinator_access
        # Connected only once everything that checks arguments or the checkpoint
        # directory has passed; a failure after that undoes the connection.
        registry.claim(self, functools.partial(edge.connect, cluster, patience=connect_timeout))
        with contextlib.ExitStack() as undo:
            undo.callback(lifecycle.leave, edge, self)
            if checkpoints is not None:
                # Each ps writes its own part of every checkpoint: it must reach the directory.
                checkpoints.check_reachable(cluster.num_ps)
            engine.start_dispatch()
            undo.callback(lifecycle.stop_dispatch, scheduler, engine.dispatcher, hang_timeout)
            engine.start_recovery()
            undo.pop_all()
        # Shuts down when shutdown() is called, the strategy is collected, or at exit.
        self._finalizer = weakref.finalize(self, lifecycle.shutdown_quietly, scheduler, engine.dispatcher,
                                           engine.recovery, engine.prober, edge, hang_timeout, engine.probes)
        # Scrapes read stats() through a weak reference: the server must not keep the strategy.
        scrapes = None if config.metrics_port is None else ScrapeSource(weakref.ref(self))
        self._metrics = None if scrapes is None else MetricsServer(config.metrics_port, scrapes)
        self._table_stats = TableStatsReader(weakref.ref(self))  # stats()'s read of the tables on the ps
        self._close_metrics = weakref.finalize(self, _close_all, self._metrics, scrapes, self._table_stats)

    # ------------------------------------------------------------------ info
    @property
    def num_ps(self) -> int:
        return self._elastic.cluster.num_ps

    @property
    def closed(self) -> bool:
        """Whether `shutdown()` was called."""
        return self._closed

    @property
    def parts(self) -> Parts:
        return self._parts  # the assembled parts: how psclient's own modules reach them; not an API

    @property
    def config(self) -> StrategyConfig:
        """What this strategy was made with (its keyword arguments, as a `psclient.StrategyConfig`)."""
        return self._config

    @property
    def pipeline_depth(self) -> int:
        return self._pipeline_depth

    def __repr__(self) -> str:
        state = "shut down" if self._closed else "connected"
        return (
            f"<psclient.ParameterServerStrategy {state}: {self.num_workers} workers, "
            f"{self.num_ps} ps, pipeline_depth={self._pipeline_depth}>"
        )

    # ------------------------------------------------------- elastic workers
    @property
    def cluster(self) -> Cluster:
        """The tasks. Its workers are every worker slot, removed ones included: `workers`
        says which are in the strategy now."""
        return self._elastic.cluster

    @property
    def workers(self) -> dict[int, str]:
        """{index: address} of the workers in the strategy now (joining ones included)."""
        return self._elastic.workers

    @property
    def num_workers(self) -> int:
        """How many workers are in the strategy now (`len(workers)`)."""
        return len(self._elastic.workers)

    def add_worker(self, address: str) -> int:
        """Add the worker task at `address` ("host:port", `psclient serve` running there).

        Returns its index once it takes work: it got the per-worker datasets,
        iterators and resources made so far, and its dispatcher threads. An
        address removed before gets its old index back. See docs/elastic.md.

        Raises:
            TypeError, ValueError: `address` is not a 'host:port' string, or is
                already a worker (or another task) of this strategy.
            TaskUnreachableError: nothing accepts connections there within
                `connect_timeout`.
            TimeoutError: it did not join within max(60 s, connect_timeout);
                it stays added and joins once it answers.
        """
        self._check_open("add_worker")
        return self._elastic.add_worker(address)

    def remove_worker(self, index_or_address: int | str, drain: bool = True) -> None:
        """Take a worker out of the strategy for good, by index or "host:port".

        It takes no new closure at once. `drain=True`: the closures running
        there finish there (up to `hang_timeout`, then they are handed back);
        `drain=False`: they go back to the front of the queue and run
        elsewhere (their side effects may happen twice, as after a failure).
        Every future resolves once. Returns once the worker is out of TF's
        view: its process may be ended then.

        Raises:
            TypeError, ValueError: not a worker of this strategy, the last
                one, or `drain` not a bool.
            TimeoutError: it takes no work, but did not leave TF's view in
                time (it or another worker hangs); it leaves once it answers
                or is gone.
        """
        self._check_open("remove_worker")
        self._elastic.remove_worker(index_or_address, drain=drain)
        k = self._steps.replicas_to_aggregate
        if k is not None and len(self._elastic.workers) < k:
            log.warning(
                "%d worker(s) left for replicas_to_aggregate=%d: no step can get %d different workers' "
                "gradients, so each waits out its bounded wait and workers contribute again (counted as "
                "'repeats' in stats()['staleness']['sync']); add workers or make a new strategy with a "
                "smaller replicas_to_aggregate.", len(self._elastic.workers), k, k)

    # ------------------------------------------------------------- variables
    @contextlib.contextmanager
    def scope(self):
        """Every `tf.Variable` created inside lives on a ps task.

        That covers raw `tf.Variable`s and Keras 3 layers and optimizers (they
        create `tf.Variable`s underneath). Entering it also makes Keras 3's
        `Variable.assign_add/assign_sub` atomic (see `psclient._keras.install`), so
        counters and metrics updated by several workers lose nothing. Placement balances bytes across ps
        tasks; an optimizer slot goes to the ps of its variable; an explicit
        `tf.device("/job:ps/task:K")` inside the scope is honoured.
        """
        self._check_open("scope")
        registry.run_scope_hooks()  # e.g. the Keras integration, registered by psclient/__init__
        place_updates_on_ps()  # optimizer updates run where their variable lives, shard by shard if partitioned
        # As in TF's strategy scope, code in it is in a cross-replica context.
        with tf.variable_creator_scope(self._store.create), _runtime.cross_replica_context():
            yield self

    @property
    def variable_partitioner(self) -> Callable | None:
        """The partitioner in use (the default "auto": a `MinSizePartitioner`; None with one ps task), or None."""
        return self._variable_partitioner

    def placement(self) -> dict:
        """Where every variable created in `scope()` lives, and bytes per ps task.

        `variables` lists each variable, or each shard of a partitioned one
        (with `part` = (index, shards), `rows` = (start, stop) and `of` = the
        full variable's name), with its ps task and bytes.
        """
        return self._store.placer.report()

    # ------------------------------------------------------------ scheduling
    def schedule(self, fn: Callable, args: tuple | list = (), kwargs: Mapping | None = None) -> Future:
        """Run `fn(*args, **kwargs)` on some free worker; return its `Future`.

        `fn` is a `tf.function` (a plain Python callable is wrapped in one,
        once). It is traced here, on the coordinator, once per input
        signature, so argument mismatches raise `TypeError` now, not later.
        A trace that meets a ps lost while nothing ran (its eager reads of ps
        state) is made again once the ps is restored (docs/fault_tolerance.md).
        Per-worker values in the arguments (iterators of
        `distribute_datasets_from_function`, `create_per_worker_resource`
        values) resolve to the executing worker's own.

        If an earlier scheduled function failed and its error has not been
        raised yet by `join()`/`done()`, it is raised here instead and `fn`
        is not scheduled.
        """
        self._check_open("schedule")
        if self._recovery.broken is not None:
            raise self._recovery.broken
        closure = self._tracer.ready_closure(fn, args, kwargs, before_trace=self._checkpoint_new_variables,
                                             submit=self._scheduler.submit, guard=self._coordinator_access.run)
        return closure.future

    def join(self, timeout: float | None = None) -> None:
        """Wait until every scheduled function has finished.

        Raises the first error a scheduled function raised since the last
        `join` (same exception type and message, plus the function's name);
        closures still queued then were cancelled (their futures raise
        `concurrent.futures.CancelledError`). The strategy stays usable.
        Raises `TimeoutError` if `timeout` seconds pass first.
        """
        check_positive("timeout", timeout, optional=True, allow_zero=True, unit="seconds")
        if not self._scheduler.join(timeout):
            raise TimeoutError(
                f"join(timeout={timeout}) timed out with "
                f"{self._scheduler.stats()['unfinished']} scheduled functions unfinished."
            )

    def done(self) -> bool:
        """Whether every scheduled function has finished. Never blocks.

        Raises the pending error of a failed function, as `join` does.
        """
        return self._scheduler.done()

    # ---------------------------------------------------- per-worker values
    def distribute_datasets_from_function(self, dataset_fn, options=None) -> PerWorkerDataset:
        """One dataset per worker, built on that worker; `iter()` of it is a
        per-worker iterator to pass to `schedule`.

        `dataset_fn(input_context)` is traced once and the traced function
        builds the dataset on each worker, as TF's coordinator does; its
        `InputContext` has `num_input_pipelines` = number of workers and
        `input_pipeline_id` = the worker's index (a scalar int64 tensor), so
        `shard()` really shards. A `tf.data.Dataset` is cloned to every
        worker. See `psclient._coordinator.data.datasets` and docs/tf_compatibility.md,
        "Datasets and per-worker values" (variables refused, workers out of rotation).
        `options` (TF's `tf.distribute.InputOptions`) must be None.
        """
        refuse_input_options(options)
        if inside_per_worker_dataset_fn():
            return dataset_in_trace(dataset_fn, self.cluster.num_workers)
        check_not_in_function("distribute_datasets_from_function")
        self._check_open("distribute_datasets_from_function")
        per_worker = per_worker_datasets(dataset_fn, self.cluster.num_workers, on_new=self._per_worker.track,
                                         is_up=self._scheduler.worker_is_up)
        self._per_worker.track(per_worker)
        return per_worker

    def experimental_distribute_dataset(self, dataset, options=None) -> PerWorkerDataset:
        """TF's name for a `tf.data.Dataset` cloned whole to every worker (`options` must be None)."""
        check_distributable(dataset, options)
        if inside_per_worker_dataset_fn():
            return dataset_in_trace(dataset, self.cluster.num_workers)
        return self.distribute_datasets_from_function(dataset)

    def create_per_worker_resource(self, fn: Callable[[], Any]) -> PerWorker:
        """Call `fn()` on every worker; pass the result to `schedule` as an argument.

        For per-worker state such as lookup tables or counters: each worker's
        value is created on that worker's device (one out of rotation: when it
        rejoins). An op error there fails the closures given it, with TF's
        `ClosureInputError` (see `psclient._coordinator.data.per_worker`).
        """
        self._check_open("create_per_worker_resource")
        per_worker = per_worker_resource(fn, self.cluster.num_workers, is_up=self._scheduler.worker_is_up)
        self._per_worker.track(per_worker)
        return per_worker

    # ------------------------------------------------------------- lifecycle
    @property
    def metrics_port(self) -> int | None:
        """The port Prometheus metrics are served on (`metrics_port=0` picks a free one), or None."""
        return None if self._metrics is None else self._metrics.port

    def stats(self, *, read_ps: bool | None = True) -> dict:
        """Counts and times, per worker and per ps task.

        Per worker: done, failed, retried, in flight, up, failures (times taken out), rejoins, last detection
        and recovery times, latencies. Per ps: up, failures, recoveries, last recovery time, closures rolled
        back. Plus queue depth, completed closures, checkpoints written and (with checkpoint_dir) their times
        and bytes; `cluster_view`: changes of TF's view of the cluster (`connection.view_changes`; while one
        is under way, `changing_for_s` > 0, no step runs). `data`: the ledgers of `psclient.data` feeds, and
        `replayed_records`: records they may have trained twice because a failure cut their step off. Per
        DynamicEmbedding table on the ps: rows, keys tracked, admissions and evictions per ps task
        (`read_ps=False`: left out, nothing read from the ps; None: left out while a ps is lost), read waiting
        for no recovery (a lost ps's shard: `available: False, recovering: True`) and at most `hang_timeout`
        for a ps that does not answer (`waiting: True`, and `embedding_stats_waiting` True, meanwhile).
        """
        stats = self._scheduler.stats()
        stats["completed"] = self._scheduler.completed()
        lost = self._published.ps_down
        stats["ps"] = [dict(dataclasses.asdict(ps), up=index not in lost)
                       for index, ps in enumerate(self._recovery.ps_stats)]
        stats["checkpoints_written"] = self._recovery.checkpoints_written
        if self._recovery.checkpoints is not None:
            stats.update(self._recovery.checkpoints.stats())  # "checkpoint" (times), "checkpoints" (its cost)
        stats["pipeline_depth"], stats["cluster_view"] = self._pipeline_depth, _runtime.view_changes()
        stats["dispatcher_threads_alive"], stats["staleness"] = self._dispatcher.alive_threads, self._steps.summary()
        stats["data"] = self._parts.ledgers.stats()  # sharded datasets' ledgers (psclient.data)
        stats["replayed_records"] = stats["data"]["replayed_records"]
        stats["dynamic_embeddings"] = {}
        if not lost if read_ps is None else read_ps:
            stats["dynamic_embeddings"], stats["embedding_stats_waiting"] = self._table_stats.read(self._hang_timeout)
        return stats

    # ------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> str:
        """Checkpoint every variable created in scope() now; return its path.

        Holds the queue only until running functions finished and each ps took
        a snapshot, so the checkpoint holds exactly the completed ones; returns
        once it is written, training going on meanwhile. Requires `checkpoint_dir`.
        """
        self._check_open("save_checkpoint")
        self._require_checkpoint_dir("save_checkpoint")
        # Through a ps loss: a ps restarted while nothing ran fails the save; the recovery
        # restores it from the newest checkpoint, then this one is taken.
        path = self._coordinator_access.run(lambda: self._recovery.checkpoint("requested"), "save_checkpoint()")
        if path is None:
            raise TimeoutError(
                f"save_checkpoint() could not pause: functions still ran after "
                f"hang_timeout={self._hang_timeout:g} s."
            )
        return path

    def restore(self) -> dict | None:
        """Resume: give every variable created in scope() its newest checkpointed value.

        Call it after creating the model, optimizer and counters (in the same
        order as the run that wrote the checkpoints) and before scheduling;
        this run then writes beside those checkpoints. Uses the newest
        complete checkpoint: a missing, corrupt or truncated newer one is
        passed over (logged). Returns `{"path": ..., "completed_closures": N,
        "skipped": [{"path", "error"}, ...]}`, or None when `checkpoint_dir`
        holds no checkpoint yet (a fresh start). Every value is read and
        checked before any is assigned: raises ValueError naming the
        checkpoint and the variables that do not match it (missing, other
        shape or dtype), or, when no checkpoint is complete, each one with
        the variable and the error.
        """
        self._check_open("restore")
        self._require_checkpoint_dir("restore")
        restored = self._coordinator_access.run(self._recovery.restore, "restore()")
        if restored is not None:
            # The data ledgers saved with it go to their feeds (now or when they are created).
            restored["data_ledgers"] = self._parts.ledgers.restore(restored.pop("meta", {}).get(LEDGERS_KEY, {}))
        return restored

    @property
    def checkpoint_dir(self) -> str | None:
        checkpoints = self._recovery.checkpoints
        return None if checkpoints is None else checkpoints.directory

    def _require_checkpoint_dir(self, what: str) -> None:
        if self._recovery.checkpoints is None:
            raise ValueError(
                f"{what}() needs a checkpoint directory. Received: checkpoint_dir=None. "
                "Expected ParameterServerStrategy(cluster, checkpoint_dir=...)."
            )

    def shutdown(self) -> None:
        """Cancel what is queued, let running calls finish, join every thread.

        Running calls get up to `hang_timeout` seconds; a thread stuck in a call to a hung task is left
        behind (logged) and exits when that task answers or dies (TF's view is kept while one hangs).
        Idempotent. Afterwards `schedule` raises `StrategyClosedError`.
        """
        with self._shutdown_lock:
            if self._closed:
                return
            self._closed = True
        self._close_metrics()
        self._finalizer()
        registry.release(self)

    # --------------------------------------------------------------- private
    def _check_open(self, what: str) -> None:
        if self._closed:
            raise StrategyClosedError(
                f"Cannot call {what}(): this ParameterServerStrategy was shut down. "
                "Create a new one to continue."
            )

    def _checkpoint_new_variables(self) -> None:
        """Checkpoint first if variables were created since the last one.

        So the newest checkpoint always holds every variable a scheduled
        function can touch (a ps recovery needs their values). A count, not
        the variables themselves: this runs on every schedule().
        """
        recovery = self._recovery
        if recovery.checkpoints is not None and self._store.count() != recovery.saved_created:
            recovery.checkpoint("new variables")


def _close_all(metrics: MetricsServer | None, scrapes: ScrapeSource | None, tables: TableStatsReader) -> None:
    for part in (metrics, scrapes, tables):  # the server first: no scrape after it
        if part is not None:
            part.close()
