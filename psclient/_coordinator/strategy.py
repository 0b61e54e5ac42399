"""`ParameterServerStrategy`: variables on ps tasks, closures on any free worker."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Mapping
from typing import Any, Callable

import tensorflow as tf

from psclient._cluster.spec import Cluster
from psclient._coordinator import dynamic_tables, lifecycle, registry
from psclient._coordinator import runtime as _runtime
from psclient._coordinator.checkpoint import check_directory
from psclient._coordinator.datasets import (
    check_distributable,
    check_not_in_function,
    dataset_in_trace,
    inside_per_worker_dataset_fn,
    per_worker_datasets,
)
from psclient._coordinator.dispatch import Dispatcher
from psclient._coordinator.elastic import Elastic, ElasticWorkers
from psclient._coordinator.per_worker import (
    PerWorker,
    PerWorkerDataset,
    has_per_worker,
    per_worker_resource,
    resolve_per_worker,
)
from psclient._coordinator.recovery import Recovery, RecoveryConfig
from psclient._coordinator.shard_feed import data_stats
from psclient._coordinator.sharding import partitioner_argument
from psclient._coordinator.stores import PerWorkerRegistry, VariableStore
from psclient._coordinator.sync import Steps, check_arguments, measuring
from psclient._coordinator.tf_api import TFStrategyAPI, refuse_input_options
from psclient._coordinator.tracing import Tracer, reject_futures, warn_unless_scheduling
from psclient._coordinator.updates import place_updates_on_ps
from psclient._core.checks import check_positive
from psclient._core.errors import StrategyClosedError
from psclient._core.future import Future
from psclient._core.health import Prober
from psclient._core.closure import Closure
from psclient._core.scheduler import Scheduler

__all__ = ["ParameterServerStrategy"]

log = logging.getLogger("psclient")

class ParameterServerStrategy(ElasticWorkers, TFStrategyAPI):
    """Train with variables on parameter servers and steps on workers.

    Args:
      cluster: a `psclient.Cluster`, a dict of jobs, a `tf.train.ClusterSpec`
        or a TF cluster resolver; must have "worker" and "ps" jobs. An
        "evaluator" job is ignored (TF hangs when it is in the training spec).
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
        then every `checkpoint_interval` seconds and/or every
        `checkpoint_every` completed functions, keeping the newest
        `checkpoints_to_keep`. Checkpoints already in the directory are
        another run's: the first save (the first `schedule()`) raises
        FileExistsError unless `restore()` resumed from them or
        `overwrite_checkpoints=True`.
      overwrite_checkpoints: start over in a `checkpoint_dir` that holds
        another run's checkpoints: they are never restored, and are deleted
        as this run's are written (keeping `checkpoints_to_keep` in all).
      hang_timeout: a worker that does not answer a probe for this many
        seconds is treated as failed; its closures run elsewhere.
      worker_timeout: with every worker gone this long, pending and new
        work fails with `WorkerUnavailableError` instead of waiting.
      ps_timeout: how long to wait for a lost ps task to come back (with a
        `checkpoint_dir`) before failing with `PSUnavailableError`.
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

    Only one strategy may be connected per process at a time (TF's eager
    context is global); `shutdown()` one before creating the next. The rest
    of `tf.distribute.Strategy`'s surface: `psclient._coordinator.tf_api`.
    """

    def __init__(
        self,
        cluster: Any,
        *,
        pipeline_depth: int = 1,
        connect_timeout: float = 30.0,
        checkpoint_dir: str | os.PathLike | None = None,
        checkpoint_interval: float | None = None,
        checkpoint_every: int | None = None,
        checkpoints_to_keep: int = 3,
        overwrite_checkpoints: bool = False,
        hang_timeout: float = 30.0,
        worker_timeout: float = 300.0,
        ps_timeout: float = 300.0,
        variable_partitioner: Callable | str | None = "auto",
        max_staleness: int | None = None,
        replicas_to_aggregate: int | None = None,
        measure_staleness: bool | None = None,
    ):
        cluster = Cluster.coerce(cluster)
        check_arguments(max_staleness, replicas_to_aggregate, cluster.num_workers)
        measured = measuring(measure_staleness, max_staleness, replicas_to_aggregate)
        variable_partitioner = partitioner_argument(variable_partitioner, cluster.num_ps)
        for name, value, integer in (
            ("checkpoint_interval", checkpoint_interval, False),
            ("checkpoint_every", checkpoint_every, True),
            ("checkpoints_to_keep", checkpoints_to_keep, True),
            ("hang_timeout", hang_timeout, False),
            ("worker_timeout", worker_timeout, False),
            ("ps_timeout", ps_timeout, False),
        ):
            check_positive(name, value, integer=integer, optional=name.startswith("checkpoint_"),
                           unit="" if integer else "seconds")
        if checkpoint_dir is not None and not isinstance(checkpoint_dir, (str, os.PathLike)):
            raise TypeError(
                "Invalid value for argument `checkpoint_dir`. Received: "
                f"checkpoint_dir={checkpoint_dir!r} of type {type(checkpoint_dir).__name__}. "
                "Expected a directory path (str or os.PathLike) or None."
            )
        if checkpoint_dir is None and (checkpoint_interval or checkpoint_every):
            raise ValueError(
                "Invalid value for argument `checkpoint_dir`. Received: checkpoint_dir=None "
                f"with checkpoint_interval={checkpoint_interval!r}, checkpoint_every="
                f"{checkpoint_every!r}. Expected a directory to write the checkpoints to."
            )
        if not isinstance(overwrite_checkpoints, bool) or (overwrite_checkpoints and checkpoint_dir is None):
            raise ValueError(
                "Invalid value for argument `overwrite_checkpoints`. Received: overwrite_checkpoints="
                f"{overwrite_checkpoints!r} with checkpoint_dir={checkpoint_dir!r}. Expected True or "
                "False, and True only with a checkpoint_dir."
            )
        check_positive("pipeline_depth", pipeline_depth, integer=True)
        check_positive("connect_timeout", connect_timeout, unit="seconds")
        if checkpoint_dir is not None:
            checkpoint_dir = check_directory(checkpoint_dir)  # a regular file fails before connecting
        _runtime.wait_reachable(cluster, connect_timeout)
        self._closed = False
        self._cluster_coordinator = None  # set by the first ClusterCoordinator(self)

        self._elastic = elastic = Elastic(cluster, connect_timeout=connect_timeout, hang_timeout=hang_timeout)
        self._pipeline_depth = pipeline_depth
        self._hang_timeout = hang_timeout
        self._shutdown_lock = threading.Lock()
        self._scheduler = Scheduler(cluster.num_workers)
        # What recovery works with: narrow collaborators, none of which holds
        # this strategy, so a forgotten strategy is collected (its finalizer
        # shuts it down) and its threads never keep it alive.
        self._store = VariableStore(cluster.num_ps, variable_partitioner)
        self._variable_partitioner = variable_partitioner
        self._per_worker = PerWorkerRegistry()
        self._steps = Steps(self._scheduler, max_staleness, replicas_to_aggregate, timeout=hang_timeout,
                            measured=measured)
        self._store.add_renew_hook(self._steps.renew)
        self._tracer = Tracer(self._store.create, self._steps if measured else None)
        prober = Prober(_runtime.probe)
        tracer_ref, scheduler, streaming = weakref.ref(self._tracer), self._scheduler, pipeline_depth > 1
        self._recovery = Recovery(
            RecoveryConfig(
                checkpoint_dir=checkpoint_dir, overwrite_checkpoints=overwrite_checkpoints,
                checkpoint_interval=checkpoint_interval, checkpoint_every=checkpoint_every,
                checkpoints_to_keep=checkpoints_to_keep, hang_timeout=hang_timeout,
                worker_timeout=worker_timeout, ps_timeout=ps_timeout,
                probe_timeout=min(10.0, hang_timeout), interval=min(1.0, hang_timeout / 4),
            ),
            cluster=cluster, scheduler=scheduler, prober=prober, store=self._store,
            per_worker=self._per_worker,
            # After variables got new resources: trace what is queued again.
            # By weak reference: the tracer holds the user's functions, which
            # may hold this strategy (a model holding the coordinator), and
            # the recovery thread must not keep them alive.
            retrace=lambda: _retrace(tracer_ref, scheduler),
            connect=lambda workers: _runtime.connect(elastic.cluster, streaming_enqueue=streaming, workers=workers),
        )
        # Connected only once everything that checks arguments or the checkpoint
        # directory has passed; a failure after that undoes the connection.
        registry.claim(self, lambda: _runtime.connect(cluster, streaming_enqueue=pipeline_depth > 1,
                                                       patience=connect_timeout))
        with contextlib.ExitStack() as undo:
            undo.callback(lifecycle.leave, self)
            if self._recovery.checkpoints is not None:
                # Each ps writes its own part of every checkpoint: it must reach the directory.
                self._recovery.checkpoints.check_reachable(cluster.num_ps)
            self._dispatcher = Dispatcher(
                self._scheduler,
                num_workers=cluster.num_workers,
                pipeline_depth=pipeline_depth,
                prepare=_prepare,
                probes=self._recovery.probes,
                report=self._recovery.report,
                release_timeout=hang_timeout,
                iterators=self._per_worker,
            )
            undo.callback(lifecycle.stop_dispatch, self._scheduler, self._dispatcher, hang_timeout)
            self._recovery.cancel_calls = self._dispatcher.cancel_calls
            elastic.attach(scheduler=self._scheduler, dispatcher=self._dispatcher, recovery=self._recovery)
            self._recovery.start()
            undo.pop_all()
        # Shuts down when shutdown() is called, the strategy is collected, or at exit.
        self._finalizer = weakref.finalize(
            self, lifecycle.shutdown_quietly, self._scheduler, self._dispatcher, self._recovery, prober, hang_timeout,
        )

    # ------------------------------------------------------------------ info
    @property
    def num_ps(self) -> int:
        return self._elastic.cluster.num_ps

    @property
    def closed(self) -> bool:
        """Whether `shutdown()` was called."""
        return self._closed

    @property
    def pipeline_depth(self) -> int:
        return self._pipeline_depth

    def __repr__(self) -> str:
        state = "shut down" if self._closed else "connected"
        return (
            f"<psclient.ParameterServerStrategy {state}: {self.num_workers} workers, "
            f"{self.num_ps} ps, pipeline_depth={self._pipeline_depth}>"
        )

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
        function, name = self._tracer.as_function(fn)
        if not isinstance(args, (tuple, list)):
            raise TypeError(
                f"Invalid value for argument `args`. Received: args={args!r} of type "
                f"{type(args).__name__}. Expected a tuple or list of positional arguments."
            )
        if kwargs is not None and not isinstance(kwargs, Mapping):
            raise TypeError(
                f"Invalid value for argument `kwargs`. Received: kwargs={kwargs!r} of type "
                f"{type(kwargs).__name__}. Expected a mapping of keyword arguments or None."
            )
        args, kwargs = self._tracer.with_defaults(function, tuple(args), dict(kwargs or {}))
        reject_futures(args, kwargs, name)
        per_worker = has_per_worker(args, kwargs)
        self._checkpoint_new_variables()
        closure = Closure(None, args, kwargs, Future(name))
        closure.per_worker = per_worker  # only walk the arguments when needed
        closure.function = function
        with self._tracer.lock:  # a ps recovery retraces under this lock
            try:
                self._tracer.prepare(closure)
            except _runtime.closure_input_error_type() as error:
                # No worker could build a per-worker argument: as in TF, the
                # closure fails with the input error when it runs (join() raises it).
                closure.fn = _raise(error)
            self._scheduler.submit(closure)
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

    # ------------------------------------- tf.distribute-style step helpers
    #: Replicas that see each step: one per worker call (TF's PS strategy on CPU says the same).
    num_replicas_in_sync = 1

    def run(self, fn: Callable, args: tuple = (), kwargs: Mapping | None = None):
        """Call `fn` as the one replica of a step: `fn(*args, **kwargs)`.

        Present so code written for TF's strategies runs. Inside `fn`,
        `tf.distribute.in_cross_replica_context()` is False and
        `tf.distribute.get_replica_context()` is the (only) replica's context.
        As TF's does, it logs a warning when called outside a function being
        scheduled: that runs on the coordinator, not on a worker.
        """
        warn_unless_scheduling("run")
        # TF's public replica context of its default strategy: replica 0 of 1.
        with tf.distribute.ReplicaContext(tf.distribute.get_strategy(), replica_id_in_sync_group=0):
            return fn(*args, **(kwargs or {}))

    def reduce(self, reduce_op, value, axis=None):
        """Reduce a per-replica value; with one replica per call only `axis` matters.

        `reduce_op` is a `tf.distribute.ReduceOp` or its name ("SUM", "MEAN").
        """
        warn_unless_scheduling("reduce")
        op = str(getattr(reduce_op, "value", reduce_op)).upper()
        if op not in ("SUM", "MEAN"):
            raise ValueError(
                f"Invalid value for argument `reduce_op`. Received: reduce_op={reduce_op!r}. "
                "Expected tf.distribute.ReduceOp.SUM or MEAN (or \"SUM\" / \"MEAN\")."
            )
        if axis is None:
            return value
        reduce = tf.reduce_sum if op == "SUM" else tf.reduce_mean
        return tf.nest.map_structure(lambda v: reduce(v, axis=axis), value)

    # ---------------------------------------------------- per-worker values
    def distribute_datasets_from_function(self, dataset_fn, options=None) -> PerWorkerDataset:
        """One dataset per worker, built on that worker; `iter()` of it is a
        per-worker iterator to pass to `schedule`.

        `dataset_fn(input_context)` is traced once and the traced function
        builds the dataset on each worker, as TF's coordinator does; its
        `InputContext` has `num_input_pipelines` = number of workers and
        `input_pipeline_id` = the worker's index (a scalar int64 tensor), so
        `shard()` really shards. A `tf.data.Dataset` is cloned to every
        worker. See `psclient._coordinator.datasets` and docs/tf_compatibility.md,
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
        `ClosureInputError` (see `psclient._coordinator.per_worker`).
        """
        self._check_open("create_per_worker_resource")
        per_worker = per_worker_resource(fn, self.cluster.num_workers, is_up=self._scheduler.worker_is_up)
        self._per_worker.track(per_worker)
        return per_worker

    # ------------------------------------------------------------- lifecycle
    def stats(self) -> dict:
        """Counts and times, per worker and per ps task.

        Per worker: done, failed, retried, in flight, up, failures (times taken
        out), rejoins, last detection and recovery times, latencies. Per ps:
        failures, recoveries, last recovery time, closures rolled back. Plus
        queue depth, completed closures and checkpoints written. `data`: the
        ledgers of `psclient.data` feeds, and `replayed_records`: records they
        may have trained twice because a failure cut their step off. Per dynamic
        embedding table (`psclient.layers.DynamicEmbedding`) on the ps: rows,
        keys tracked, admissions and evictions per ps task.
        """
        import dataclasses

        stats = self._scheduler.stats()
        stats["completed"] = self._scheduler.completed()
        stats["ps"] = [dataclasses.asdict(ps) for ps in self._recovery.ps_stats]
        stats["checkpoints_written"] = self._recovery.checkpoints_written
        stats["pipeline_depth"] = self._pipeline_depth
        stats["dispatcher_threads_alive"] = self._dispatcher.alive_threads
        stats["staleness"] = self._steps.summary()
        stats["data"] = data_stats(self)  # sharded datasets' ledgers (psclient.data)
        stats["replayed_records"] = stats["data"]["replayed_records"]
        stats["dynamic_embeddings"] = dynamic_tables.stats_on_ps(self)
        return stats

    # ------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> str:
        """Checkpoint every variable created in scope() now; return its path.

        Waits for running functions to finish first (and holds the queue
        meanwhile), so the checkpoint holds exactly the completed ones.
        Requires `checkpoint_dir`.
        """
        self._check_open("save_checkpoint")
        self._require_checkpoint_dir("save_checkpoint")
        path = self._recovery.checkpoint("requested")
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
        return self._recovery.restore()

    @property
    def checkpoint_dir(self) -> str | None:
        return self._recovery.config.checkpoint_dir

    def _require_checkpoint_dir(self, what: str) -> None:
        if self._recovery.checkpoints is None:
            raise ValueError(
                f"{what}() needs a checkpoint directory. Received: checkpoint_dir=None. "
                "Expected ParameterServerStrategy(cluster, checkpoint_dir=...)."
            )

    def shutdown(self) -> None:
        """Cancel what is queued, let running calls finish, join every thread.

        Running calls get up to `hang_timeout` seconds; a thread stuck in a
        call to a hung worker is left behind (logged) and exits when that
        worker answers or dies. Idempotent. Afterwards `schedule` raises
        `StrategyClosedError`.
        """
        with self._shutdown_lock:
            if self._closed:
                return
            self._closed = True
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


def _retrace(tracer_ref: "weakref.ref[Tracer]", scheduler: Scheduler) -> None:
    tracer = tracer_ref()
    if tracer is not None:  # None: the strategy is being collected
        tracer.retrace(scheduler.queued())


def _prepare(closure: Closure, worker: int) -> tuple:
    """What a dispatcher calls for `closure` on `worker` (per-worker values resolved)."""
    if not closure.per_worker:
        return closure.fn, closure.args, closure.kwargs
    args, kwargs = resolve_per_worker(closure.args, closure.kwargs, worker)
    return closure.fn, args, kwargs


def _raise(error: BaseException) -> Callable:
    def fail(*_args, **_kwargs):
        raise error

    return fail
