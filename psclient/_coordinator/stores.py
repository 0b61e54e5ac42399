"""What recovery needs from the strategy, as small objects of their own.

`VariableStore` creates every variable of `strategy.scope()` on a ps task and
keeps them (weakly) in creation order; `PerWorkerRegistry` keeps (weakly) the
per-worker values built so far. The recovery thread gets these two, not the
strategy: nothing it holds keeps a strategy alive.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import weakref
from typing import Any, Callable

import tensorflow as tf

from psclient._coordinator import runtime as _runtime
from psclient._coordinator.checkpoints import checkpoint_pieces as _pieces
from psclient._coordinator.checkpoints.checkpoint import variable_key
from psclient._coordinator.data.per_worker import PerWorker, PerWorkerDataset, PerWorkerIterator, worker_context_lost
from psclient._coordinator.variables import initial_values
from psclient._coordinator.variables.sharding import create_partitioned, cut, is_partitioned
from psclient._core.partitioning import can_split, row_ranges, shard_count, shard_tasks
from psclient._core.placement import Placer
from psclient._tf import context as _context
from psclient._tf import variables as _tf_variables
from psclient._tf import write_marks as _write_marks
from psclient._tf.executors import register_read_kinds

__all__ = ["VariableStore", "PerWorkerRegistry"]


def tf_dtype_size(dtype) -> int:
    return tf.as_dtype(dtype).size

log = logging.getLogger("psclient")


class VariableStore:
    """Every variable created in scope(), in creation order, with its ps task(s).

    With a `partitioner`, a variable it cuts into several shards is a
    `PartitionedVariable` whose shards sit on consecutive ps tasks (see
    `psclient._core.partitioning`); it counts as one variable here (one
    checkpoint key) with one ps task per shard.
    """

    def __init__(self, num_ps: int, partitioner: Callable | None = None, *,
                 on_renew: tuple[Callable[[set], None], ...] = (), write_marks: bool = False):
        self._num_ps = num_ps
        self._partitioner = partitioner
        # Whether a variable (or shard) above one checkpoint row chunk (8 MiB) gets write marks
        # (`psclient._tf.write_marks`): its cut then reads again only the rows written since
        # its copy began (`checkpoints.fuzzy_copy`).
        self._marking = write_marks
        #: `guard(make, what)`: a variable made through a ps loss (the strategy's coordinator
        #: access, set once the engine exists; psclient._coordinator.ps_state).
        self.guard: Callable = lambda make, what: make()
        self.placer = Placer(num_ps)
        self._lock = threading.Lock()
        self._variables: list[tuple[weakref.ref, tuple[int, ...]]] = []
        # Set while this thread creates the shards of a partitioned variable:
        # a nested scope's creator (the tracer's inside the user's scope)
        # passes a shard straight through instead of cutting it again.
        self._making_shards = threading.local()
        # Bound methods called with the lost ps tasks after `renew` (state of
        # psclient's own lived there too), held weakly: the recovery thread
        # holds this store, and their owners hold the user's functions, which
        # may hold the strategy (a forgotten strategy must be collected).
        self._on_renew = [weakref.WeakMethod(method) for method in on_renew]
        # Dynamic embedding tables made under this strategy, in creation order (weakly): saved
        # by their ps tasks beside the variables, re-made with them when a ps is lost.
        self._tables: list[weakref.ref] = []
        # The lock of the bounded tables' shards on each ps task (one per task: a training step
        # admits into all of that task's tables at once): re-made with the task's resources.
        self._table_locks: dict[str, Any] = {}
        self._unmanaged = threading.local()

    @contextlib.contextmanager
    def unmanaged(self):
        """Variables created inside (by this thread) are left alone: not placed, saved or renewed.

        For a dynamic table's bookkeeping (its clock and counters), placed
        by the table itself and saved with its rows: they are no model
        variables, and their number depends on the number of ps tasks.
        """
        before = getattr(self._unmanaged, "active", False)  # nested (a table's storage, then its marks)
        self._unmanaged.active = True
        try:
            yield
        finally:
            self._unmanaged.active = before

    def create(self, next_creator, **kwargs):
        """A `tf.variable_creator_scope` creator: place the variable on a ps task."""
        if kwargs.pop("per_worker_variable", False):
            raise ValueError(
                "Invalid value for argument `per_worker_variable` of tf.Variable. Received: "
                "per_worker_variable=True inside psclient's strategy.scope(). Expected False: "
                "psclient does not make TF's PerWorkerVariable (a variable whose reads in a "
                "scheduled function resolve to the running worker's copy). Make one variable per "
                "worker with `per_worker = strategy.create_per_worker_resource(lambda: "
                "tf.Variable(...))`, pass `per_worker` to schedule() as an argument, and read "
                "every copy with `[v.numpy() for v in per_worker.values]` (TF's read_all())."
            )
        if getattr(self._making_shards, "active", False) or getattr(self._unmanaged, "active", False):
            return next_creator(**kwargs)
        # A device already in force names a ps task when Keras asks to
        # colocate a slot with its variable (its optimizer enters
        # `colocate_vars_with`, which in eager mode is a device scope) or when
        # the user chose one explicitly.
        device = _context.current_device()
        if "/job:worker" in (device or ""):
            # Built for one worker on purpose (create_per_worker_resource, or
            # the user's tf.device): leave it there.
            return next_creator(**kwargs)
        requested = _runtime.ps_index_of(device)
        if requested is not None and requested >= self._num_ps:
            requested = None
        reason = "balanced" if requested is None else "requested"
        # A Keras variable's description (shape, dtype, how to make a shard),
        # taken here, by the outermost psclient creator, and only once.
        spec = initial_values.take_pending()
        # Made again whole (its value too, from a fresh copy of the arguments) if a ps is lost
        # under it: outside a trace, the guard waits for the recovery first.
        return self.guard(lambda: self._create_placed(next_creator, dict(kwargs), spec, requested, reason),
                          f"creating variable {kwargs.get('name')!r} on the ps")

    def _create_placed(self, next_creator, kwargs, spec, requested, reason):
        initial_value = kwargs.get("initial_value")
        lifted = _tf_variables.lifted_initial_value(initial_value, kwargs.get("name"))
        if lifted is not None:  # a tensor of the function being traced: its ops made again on the ps
            kwargs["initial_value"] = initial_value = lifted
        if callable(initial_value) and not initial_values.is_checkpoint_value(initial_value):
            return self._create_on_ps(next_creator, kwargs, initial_value, spec, requested, reason)
        if callable(initial_value):
            with tf.init_scope():  # a restore from a file: read where the file is
                kwargs["initial_value"] = initial_value = initial_value()
        dtype = kwargs.get("dtype")
        # Under init_scope: while a function is traced (an optimizer making its
        # slots at its first apply_gradients) the value would otherwise be
        # captured as a placeholder, and the shards cut from it could not be
        # lifted out of the function.
        with tf.init_scope():
            value = tf.convert_to_tensor(initial_value, dtype=dtype) if initial_value is not None else None
        return self._create_from_value(next_creator, kwargs, value, requested, reason)

    def _create_on_ps(self, next_creator, kwargs, fn, spec, requested, reason):
        """A variable whose initial value `fn` makes: made on its ps (see `initial_values`)."""
        shape, dtype = initial_values.known_shape(kwargs, spec)
        if shape is None:
            # Nothing says what `fn` makes: make it on the task that would get
            # the variable anyway (whole-variable placement does not depend on
            # its size), then carry on as with a value.
            ps = requested if requested is not None else self.placer.choose(0)
            with tf.init_scope(), tf.device(_runtime.ps_device(ps)):
                value = tf.convert_to_tensor(fn(), dtype=kwargs.get("dtype"))
            kwargs["initial_value"] = value
            return self._create_from_value(next_creator, kwargs, value, ps, reason)
        if spec is not None and kwargs.get("shape") is None:
            kwargs["shape"] = shape  # for a nested psclient creator, which has no spec
        shards = self._shards(kwargs.get("name"), shape, dtype)
        if shards > 1:
            with tf.init_scope():
                return self._create_partitioned(
                    next_creator, kwargs, shape, dtype, shards, requested, reason,
                    lambda ranges, devices: initial_values.shard_values(fn, spec, shape, ranges, devices))
        return self._create_whole(next_creator, kwargs, requested, reason)

    def _create_from_value(self, next_creator, kwargs, value, ps, reason):
        """A variable with an initial tensor `value` (None: TF's restore-time variables)."""
        if value is not None and value.shape.is_fully_defined():
            shape, dtype = tuple(value.shape.as_list()), value.dtype
            shards = self._shards(kwargs.get("name"), shape, dtype)
            if shards > 1:
                with tf.init_scope():
                    return self._create_partitioned(
                        next_creator, kwargs, shape, dtype, shards, ps, reason,
                        lambda ranges, devices: (cut(value, ranges), lambda: None))
        return self._create_whole(next_creator, kwargs, ps, reason)

    def _create_whole(self, next_creator, kwargs, ps, reason):
        if ps is None:
            # Greedy by bytes chooses the least-loaded task whatever the new
            # variable's size: no need to know it (or make it) first.
            ps = self.placer.choose(0)
        # init_scope: see `create`; the device: a callable initial value runs there.
        with tf.init_scope(), tf.device(_runtime.ps_device(ps)):
            variable = next_creator(**kwargs)
        register_read_kinds(variable.dtype)  # its `numpy()` then waits for no hung worker
        self._mark_writes(variable)
        with self._lock:
            self._variables.append((weakref.ref(variable), (ps,)))
        shape = variable.shape.as_list() if variable.shape.rank is not None else ()
        nbytes = variable.shape.num_elements() * variable.dtype.size if variable.shape.is_fully_defined() else 0
        self.placer.record(variable.name, shape, variable.dtype.name, nbytes, ps, reason)
        return variable

    def _shards(self, name, shape, dtype) -> int:
        """How many shards the partitioner wants for a variable of `shape` (1: keep it whole)."""
        if self._partitioner is None or not can_split(list(shape)):
            return 1  # a scalar, an unknown shape or a single row: never offered
        result = self._partitioner(tf.TensorShape(list(shape)), tf.as_dtype(dtype))
        return shard_count(name or "Variable", list(shape), result)

    def _create_partitioned(self, next_creator, kwargs, shape, dtype, shards, first, reason, make_parts):
        """The shards of a partitioned variable; `make_parts(ranges, devices)` gives their initial values."""
        row_bytes = tf_dtype_size(dtype)
        for dim in shape[1:]:
            row_bytes *= dim
        if first is None:
            first = self.placer.choose(shape[0] * row_bytes)
        tasks = shard_tasks(first, shards, self._num_ps)
        ranges = row_ranges(shape[0], shards)
        devices = [_runtime.ps_device(ps) for ps in tasks]
        parts, release = make_parts(ranges, devices)
        self._making_shards.active = True
        try:
            variable = create_partitioned(next_creator, kwargs, parts, devices)
        finally:
            self._making_shards.active = False
            release()
        register_read_kinds(dtype, shards)  # its `numpy()`, read shard by shard and joined here
        for shard in variable.variables:
            self._mark_writes(shard)
        with self._lock:
            self._variables.append((weakref.ref(variable), tuple(tasks)))
        for index, (shard, ps, (start, stop)) in enumerate(zip(variable.variables, tasks, ranges)):
            self.placer.record(
                shard.name, shard.shape.as_list(), shard.dtype.name, (stop - start) * row_bytes, ps, reason,
                part=(index, shards), rows=(start, stop), of=shard.name.rsplit("/part_", 1)[0],
            )
        return variable

    def _mark_writes(self, variable: Any) -> None:
        """Write marks for `variable` (a tf.Variable on a ps) if it is above one checkpoint row chunk."""
        if variable.shape.is_fully_defined():
            self.mark_writes(variable, variable.shape.as_list())

    @property
    def marks_writes(self) -> bool:
        """Whether this store's checkpoints copy before the cut (write marks, `mark_writes`)."""
        return self._marking

    def mark_writes(self, variable: Any, shape: list[int], force: bool = False) -> bool:
        """Give `variable` (on a ps, of `shape`: a dynamic table's storage has no static one) write
        marks where this store marks writes and it is above one checkpoint row chunk (`force`: of any
        size, a table's keys copied with its rows); whether it did."""
        if not self._marking or (not force and _pieces.chunk_rows(shape, variable.dtype, aligned=False) is None):
            return False
        _write_marks.attach(variable, functools.partial(self._make_mark, variable.device), rows=shape[0])
        return True

    def _make_mark(self, device: str, value: Any, name: str) -> Any:
        with self.unmanaged(), tf.init_scope(), tf.device(device):
            return tf.Variable(value, trainable=False, name=name)

    def count(self) -> int:
        """Variables created so far (dead ones included: keys are creation indices)."""
        return len(self._variables)

    def named(self) -> dict[str, Any]:
        """Live variables, keyed by creation index (`variable_key`)."""
        with self._lock:
            entries = list(self._variables)
        named = {}
        for index, (ref, _tasks) in enumerate(entries):
            variable = ref()
            if variable is not None:
                named[variable_key(index)] = variable
        return named

    def renew(self, lost_ps) -> int:
        """New (uninitialized) resources for the live variables on `lost_ps`; how many."""
        count = 0
        for part, ps in self._live_parts():
            if ps in lost_ps:
                _runtime.renew_variable_handle(part, _runtime.ps_device(ps))
                count += 1
                marks = _write_marks.marks_of(part)
                if marks is not None:  # psclient's own: new, and cleared at once (writes mark them)
                    for mark in marks.variables():
                        _runtime.renew_variable_handle(mark, _runtime.ps_device(ps))
                    with tf.device(_runtime.ps_device(ps)):
                        marks.reset()
        with self._lock:  # the lost tasks' locks died with them: the tables' renewal makes new ones
            for ps in lost_ps:
                self._table_locks.pop(_runtime.ps_device(ps), None)
        for table in self.tables().values():
            table.renew(set(lost_ps))
        for ref in self._on_renew:
            hook = ref()
            if hook is not None:
                hook(set(lost_ps))
        return count

    def add_table(self, table: Any) -> None:
        """Track a dynamic embedding table (`psclient._coordinator.tables.dynamic_tables.DynamicTable`)."""
        with self._lock:
            self._tables.append(weakref.ref(table))

    def table_lock(self, device: str) -> Any:
        """The `tf.CriticalSection` the bounded tables' shards on `device` (a ps task) share."""
        with self._lock:
            lock = self._table_locks.get(device)
            if lock is None:
                with tf.init_scope(), tf.device(device):
                    lock = tf.CriticalSection(name=f"psclient_tables_ps{_runtime.ps_index_of(device)}")
                self._table_locks[device] = lock
            return lock

    def tables(self) -> dict[str, Any]:
        """Live dynamic tables keyed by creation index (`table/0000`), as variables are."""
        with self._lock:
            refs = list(self._tables)
        return {f"table/{index:04d}": table for index, ref in enumerate(refs) if (table := ref()) is not None}

    def one_per_ps(self) -> dict[int, Any]:
        """A live variable (or shard) on each ps task that holds any: what shows
        whether that task still holds the resources this coordinator made."""
        found: dict[int, Any] = {}
        for part, ps in self._live_parts():
            found.setdefault(ps, part)
            if len(found) == self._num_ps:
                break
        return found

    def _live_parts(self):
        """(variable or shard, its ps task) of every live variable, in creation order."""
        with self._lock:
            entries = list(self._variables)
        for ref, tasks in entries:
            variable = ref()
            if variable is not None:
                parts = variable.variables if is_partitioned(variable) else (variable,)
                yield from zip(parts, tasks)


class PerWorkerRegistry:
    """The per-worker values built so far (weakly), to rebuild after failures."""

    def __init__(self):
        self._lock = threading.Lock()
        self._refs: list[weakref.ref] = []
        # Per worker: how many times its iterators were renewed (see renew_iterators).
        self._renew_lock = threading.Lock()
        self._generations: dict[int, int] = {}

    def track(self, value: PerWorker) -> None:
        with self._lock:
            self._refs.append(weakref.ref(value))

    def values(self) -> list[PerWorker]:
        with self._lock:
            self._refs = [ref for ref in self._refs if ref() is not None]
            refs = list(self._refs)
        return [value for value in (ref() for ref in refs) if value is not None]

    def generation(self, worker: int) -> int:
        """Changes each time `worker`'s iterators are renewed."""
        return self._generations.get(worker, 0)

    def renew_iterators(self, worker: int, seen_generation: int) -> int:
        """Make `worker`'s iterators again from their datasets (kept).

        For an iterator that was cancelled on a worker that is fine. Several
        calls that failed on the same cancelled iterators renew them once: a
        caller passes the `generation` it saw before its call, and nothing is
        done if the iterators were renewed since. Returns how many were made.
        """
        with self._renew_lock:
            if self.generation(worker) != seen_generation:
                return 0
            iterators = [v for v in self.values() if isinstance(v, PerWorkerIterator)]
            for iterator in iterators:
                iterator.renew(worker)
            self._generations[worker] = seen_generation + 1
            return len(iterators)

    def endless(self, args: tuple, kwargs: dict, worker: int) -> bool:
        """Whether `args`/`kwargs` hold per-worker iterators and each reads, on
        `worker`, a dataset that never ends (see `PerWorkerIterator.endless`)."""
        iterators = [value for value in tf.nest.flatten((args, kwargs)) if isinstance(value, PerWorkerIterator)]
        return bool(iterators) and all(iterator.endless(worker) for iterator in iterators)

    def rebuild(self, worker: int | None, *, resources_only: bool) -> None:
        """Build the per-worker values of `worker` (or of every worker) again.

        With `resources_only`, datasets and iterators are kept (their state lives
        on workers that did not fail; after a ps recovery they read on from where
        they were); resources from `create_per_worker_resource` are rebuilt.
        """
        # On the recovery's thread, inside its own executor (recovery.py: seed 500's rebuild waited in a
        # stream of TF's shared default executor 19 s after every fault had ended).
        for value in self.values():
            if resources_only and isinstance(value, (PerWorkerDataset, PerWorkerIterator)):
                continue
            if worker is not None:
                value.rebuild(worker)  # a rejoin: its failure is the rejoin's, retried by it
                continue
            for index in range(value.num_workers):
                try:
                    value.rebuild(index)
                except tf.errors.OpError as error:
                    if not worker_context_lost(error, index):
                        raise
                    # A worker that is down (after a ps recovery, say) keeps its value
                    # pending: it is built when the worker rejoins, or by the first
                    # closure that needs it there. The other workers' go on.
                    log.info("%s: worker %d did not answer, or no longer holds its context (%s); its value is built "
                             "when it is back",
                             value.name, index, type(error).__name__)
