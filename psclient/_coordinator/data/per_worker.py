"""Values that exist once per worker: datasets, iterators, resources.

A `PerWorker` holds one value per worker, each built *on* that worker by a
builder function. Passed to `schedule`, it resolves to the value of whichever
worker runs the closure. Builders are kept, so a worker that comes back after
a failure gets its values rebuilt (datasets before the iterators made from
them) before it takes work again.

A worker's value is in one of three states:
- built;
- pending: the worker was out of rotation, or its connection failed, when the
  value was made. It is built when the worker rejoins (the registry's
  rebuild) or, at the latest, by the first closure that needs it there (so a
  connection that failed for a moment costs nothing but that closure's retry);
- failed: building it raised an error of its own (an op error, not a lost
  connection, nor TF's word that the worker no longer holds a tensor the
  build named: `worker_context_lost`). As with TF's coordinator, a closure given that value fails
  with TF's `ClosureInputError` without running, at `join()` or its future;
  so does every later one on that worker, until the worker restarts and the
  value is built again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from psclient._coordinator import runtime as _runtime
from psclient._core.checks import signature_refusing_one_argument
from psclient._core.failures import is_connection_error_type, stale_worker_context
from psclient._tf.data import deserialize_dataset, serialize_dataset
from psclient._tf.functions import fresh_tf_function

__all__ = [
    "PerWorker",
    "PerWorkerDataset",
    "PerWorkerIterator",
    "call_dataset_fn",
    "check_dataset_fn",
    "dataset_cloner",
    "deserialize_dataset",
    "has_per_worker",
    "per_worker_resource",
    "refuse_variables",
    "resolve_per_worker",
    "serialize_dataset",
    "without_autotune_model",
    "worker_context_lost",
]

log = logging.getLogger("psclient")

#: A worker's value not built yet (see the module doc).
_PENDING = object()


def worker_context_lost(error: BaseException, worker: int) -> bool:
    """Whether a build's `error` is no error of its function: the connection was lost, or TF says
    the worker does not hold the coordinator's context as the build named it (a tensor of an older
    context, its own device unknown: `psclient._core.failures.stale_worker_context`).

    Such a value stays pending, never failed: a chaos plan (ps 0 killed, a worker hung during its
    recovery, then back) failed a Keras `fit` when the worker's rejoin took TF's "Unable to find the
    relevant tensor remote_handle" for an error of the dataset's own, and every later closure there
    with it."""
    return is_connection_error_type(error) or stale_worker_context(error, _runtime.worker_device(worker))


class _Failed:
    """A worker's value whose build raised `error` (see the module doc)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


class PerWorker:
    """One value per worker, built by `build(worker_index)` on that worker.

    `is_up(worker)` (optional) tells which workers are in rotation: the others
    get their value when they rejoin. Lost connections while building leave the
    value pending; other op errors leave it failed (module doc). Any other
    exception (a bug in the function) is raised here. With `build_now=False`
    every value starts pending: each worker's is built by its first closure,
    on that worker's dispatcher thread (see `PerWorkerDataset`).
    """

    def __init__(self, build: Callable[[int], Any], num_workers: int, name: str, *,
                 is_up: Callable[[int], bool] | None = None, build_now: bool = True):
        self._build = build
        self._name = name
        self._lock = threading.Lock()
        # One build at a time per worker: pipeline_depth threads may need it at once.
        self._build_locks = [threading.Lock() for _ in range(num_workers)]
        self._values: list[Any] = [_PENDING] * num_workers
        for worker in range(num_workers if build_now else 0):
            if is_up is not None and not is_up(worker):
                log.info("%s: worker %d is out of rotation; its value is built when it rejoins",
                         name, worker)
                continue
            try:
                self._values[worker] = self._attempt(worker)
            except tf.errors.OpError as error:  # only a lost connection (or context) gets out of _attempt
                log.warning("%s: could not build worker %d's value now (%s); it is built when "
                            "the worker answers again", name, worker, type(error).__name__)

    @property
    def name(self) -> str:
        return self._name

    @property
    def num_workers(self) -> int:
        return len(self._values)

    def _grow(self, worker: int) -> None:
        """Slots up to `worker`, pending: a worker that joined after this value was made
        (`strategy.add_worker`) gets its value built as any pending one."""
        with self._lock:
            while len(self._values) <= worker:
                self._values.append(_PENDING)
                self._build_locks.append(threading.Lock())

    def value(self, worker: int) -> Any:
        """The value that lives on worker `worker` (built now if it is pending).

        Raises TF's `ClosureInputError` if building it failed, and the
        connection error if the worker cannot be reached to build it.
        """
        self._grow(worker)
        value = self._values[worker]
        if value is _PENDING:
            with self._build_locks[worker]:
                value = self._values[worker]
                if value is _PENDING:
                    value = self._attempt(worker)  # a lost connection raises: the caller's call fails
                    with self._lock:
                        self._values[worker] = value
        if isinstance(value, _Failed):
            raise self._input_error(worker, value.error)
        return value

    @property
    def values(self) -> tuple:
        """Every worker's value, in worker order (None where pending or failed)."""
        return tuple(None if v is _PENDING or isinstance(v, _Failed) else v for v in self._values)

    def built(self, worker: int) -> bool:
        """Whether worker `worker`'s value is built (neither pending nor failed)."""
        self._grow(worker)
        value = self._values[worker]
        return value is not _PENDING and not isinstance(value, _Failed)

    def sample(self) -> Any:
        """What a function is traced with for this argument: a built value.

        Raises TF's `ClosureInputError` if every worker failed to build it.
        """
        for worker in range(self.num_workers):
            if self.built(worker):
                return self._values[worker]
        for worker, value in enumerate(self._values):
            if isinstance(value, _Failed):
                raise self._input_error(worker, value.error)
        raise RuntimeError(
            f"{self._name!r} has no value on any worker yet: every worker was out of rotation "
            "or failed to build it. Schedule again once a worker is back (it is built then)."
        )

    def rebuild(self, worker: int) -> None:
        """Build worker `worker`'s value again (its old one died with it).

        A lost connection raises (the caller retries later) and leaves the
        value pending; an op error leaves it failed.
        """
        self._grow(worker)
        with self._lock:
            self._values[worker] = _PENDING
        value = self._attempt(worker)
        with self._lock:
            self._values[worker] = value

    def _attempt(self, worker: int) -> Any:
        """`build(worker)`, or `_Failed` for an op error that is not a lost connection."""

        try:
            # A builder that can trace its function anew (a traced dataset function's `remake`) does so
            # for a registration lost on its way; the others (called eagerly) raise as before.
            return _runtime.until_registered(lambda: self._build(worker), remake=getattr(self._build, "remake", None))
        except _runtime.closure_input_error_type() as error:  # a value it is built from failed
            return _Failed(error.original_exception)
        except tf.errors.OpError as error:
            if worker_context_lost(error, worker):
                raise
            log.warning("%s: building worker %d's value failed: %s: %s", self._name, worker,
                        type(error).__name__, str(error).splitlines()[0] if str(error) else "")
            return _Failed(error)

    def _input_error(self, worker: int, original: BaseException) -> Exception:

        first = str(original).splitlines()[0] if str(original) else ""
        return _runtime.closure_input_error(original, (
            f"Input has an error: the per-worker value {self._name!r} could not be built on "
            f"worker {worker} ({type(original).__name__}: {first}). The scheduled function was "
            "not run. Every closure given this value on that worker fails the same way until "
            "the worker restarts and the value is built again; fix what its function does."
        ))

    def __repr__(self) -> str:
        return f"<psclient.PerWorker {self._name!r} on {len(self._values)} workers>"


class PerWorkerDataset(PerWorker):
    """A `tf.data.Dataset` per worker; `iter()` gives a per-worker iterator.

    `element_spec` is known without any worker when the dataset function was
    traced (or the dataset given); otherwise it is read from a built dataset.

    With the spec known, nothing is built on a worker here: each worker's
    dataset (and iterator) is built by its first closure, on that worker's
    dispatcher thread, as TF's coordinator makes them with closures of their
    own. Built from the calling thread, one hung worker held it (and a Keras
    `fit` starting) until the worker answered. An untraceable dataset
    function's datasets are built here, as the spec needs one of them.
    """

    def __init__(self, build, num_workers, name, *, make_iterator: Callable[[int, Any], Any], on_new,
                 element_spec=None, is_up: Callable[[int], bool] | None = None):
        self._element_spec = element_spec
        self._make_iterator = make_iterator
        self._on_new = on_new
        self._is_up = is_up
        self.built_by_closures = element_spec is not None
        super().__init__(build, num_workers, name, is_up=is_up, build_now=not self.built_by_closures)

    @property
    def element_spec(self):
        """The type specification of an element of each worker's dataset."""
        if self._element_spec is None:
            self._element_spec = PerWorker.sample(self).element_spec
        return self._element_spec

    @property
    def _type_spec(self):
        return tf.data.DatasetSpec(self.element_spec)

    def __tf_tracing_type__(self, context):
        # tf.function traces a function given this as it would one given a worker's dataset.
        return self._type_spec

    def sample(self):
        return self._type_spec

    def build(self) -> PerWorkerDataset:
        """TF's `build()`: make the datasets on the workers without an iterator.

        psclient makes each worker's when its first closure needs it (or, for
        an untraceable dataset function, when the per-worker dataset is
        created), so this returns the object itself; passed to `schedule`, it
        resolves to the executing worker's dataset.
        """
        return self

    def __iter__(self) -> PerWorkerIterator:
        iterator = PerWorkerIterator(self, self._make_iterator, is_up=self._is_up)
        self._on_new(iterator)
        return iterator


class PerWorkerIterator(PerWorker):
    """An iterator per worker over that worker's dataset.

    Rebuilding a worker's iterator rebuilds its dataset first, because the
    dataset's resources died with the worker too. Its type spec is that of
    each worker's iterator, so `tf_function.get_concrete_function(iterator)`
    traces the trace `schedule` then uses.
    """

    def __init__(self, dataset: PerWorkerDataset, make_iterator: Callable[[int, Any], Any], *,
                 is_up: Callable[[int], bool] | None = None):
        self._dataset = dataset
        super().__init__(
            lambda i: self._iterator_over_dataset(i, make_iterator),
            dataset.num_workers,
            f"iter({dataset.name})",
            is_up=is_up,
            build_now=not dataset.built_by_closures,
        )

    @property
    def element_spec(self):
        return self._dataset.element_spec

    @property
    def _type_spec(self):
        return tf.data.IteratorSpec(self.element_spec)

    def __tf_tracing_type__(self, context):
        return self._type_spec

    def sample(self):
        return self._type_spec

    def _iterator_over_dataset(self, worker: int, make_iterator: Callable[[int, Any], Any]) -> Any:
        dataset = self._dataset.value(worker)
        try:
            return make_iterator(worker, dataset)
        except tf.errors.OpError as error:
            if not stale_worker_context(error, _runtime.worker_device(worker)):
                raise
            # The worker's dataset was made in a context the worker no longer holds (it left TF's
            # view and came back, or restarted unnoticed): made again with the iterator, once.
            log.info("%s: worker %d no longer holds its dataset (%s); making both again", self.name, worker,
                     type(error).__name__)
            self._dataset.rebuild(worker)
            return make_iterator(worker, self._dataset.value(worker))

    def rebuild(self, worker: int) -> None:
        self._dataset.rebuild(worker)
        super().rebuild(worker)

    def renew(self, worker: int) -> None:
        """A new iterator over the worker's existing dataset (the old one broke, the worker did
        not; if the worker no longer holds that dataset, both are made again)."""
        super().rebuild(worker)

    def endless(self, worker: int) -> bool:
        """Whether the worker's dataset never ends (its cardinality is infinite).

        An end of sequence from an endless dataset is a broken iterator: a
        `repeat()` whose next pass was being made when a call was cancelled
        (a task lost meanwhile) keeps saying "End of sequence" for good.
        One op on the worker, asked only after such an error.
        """
        dataset = self._dataset.value(worker)
        with tf.device(_runtime.worker_device(worker)):
            cardinality = dataset.cardinality()
        return int(cardinality) == int(tf.data.INFINITE_CARDINALITY)

    def __next__(self):
        raise TypeError(
            "A per-worker iterator cannot be advanced on the coordinator; pass it to "
            "strategy.schedule(fn, args=(iterator,)) and call next() inside fn."
        )


def check_dataset_fn(dataset_fn: Callable, argument: str = "dataset_fn") -> None:
    """Reject what cannot be a dataset function: not callable, or not taking one argument.

    `argument` is the name the user gave it (`dataset_fn`, or `x` in Keras's fit).
    """
    if not callable(dataset_fn):
        raise TypeError(
            f"Invalid value for argument `{argument}`. Received: "
            f"{argument}={dataset_fn!r} of type {type(dataset_fn).__name__}. Expected a "
            "tf.data.Dataset or a function input_context -> tf.data.Dataset."
        )
    signature = signature_refusing_one_argument(dataset_fn)
    if signature is not None:
        raise TypeError(
            f"Invalid value for argument `{argument}`. Received: a function with signature "
            f"{getattr(dataset_fn, '__name__', 'dataset_fn')}{signature}. Expected a function "
            "taking exactly one argument, the tf.distribute.InputContext (use "
            "input_context.num_input_pipelines and input_context.input_pipeline_id to shard), "
            "and returning a tf.data.Dataset."
        )


def call_dataset_fn(dataset_fn: Callable, input_context, argument: str = "dataset_fn"):
    """`dataset_fn(input_context)`, which must be a `tf.data.Dataset`."""
    dataset = dataset_fn(input_context)
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(
            f"Invalid value for argument `{argument}`: the dataset function returned an "
            f"object of type {type(dataset).__name__}. Expected a tf.data.Dataset."
        )
    return dataset


def without_autotune_model(dataset):
    """`dataset` without tf.data's autotuning model thread, unless its options set `autotune.enabled`.

    Why: deleting a tf.data iterator whose model thread waits between optimizations can wait for
    the rest of that wait, which grows to 60 s on a long-lived iterator (TF's cancellation callback
    wakes the thread before the cancellation reads as done, and it waits again): measured in one
    process under load, 2 of 4 iterators deleted after 60 s of reading took 22.06 s, none of 4
    without the model (0.28-0.50 s), at the same speed. A worker's iterators are deleted when its
    context closes, and TF's reconnect and disconnect wait for that: seeded chaos plans waited
    16-111 s there (docs/chaos.md). `num_parallel_calls=AUTOTUNE` then means the worker's cores,
    and `prefetch(AUTOTUNE)` keeps its own buffer tuning.
    """
    if dataset.options().autotune.enabled is not None:
        return dataset  # the user's choice
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


def has_per_worker(args: tuple, kwargs: dict) -> bool:
    return any(isinstance(x, PerWorker) for x in tf.nest.flatten((args, kwargs)))


def resolve_per_worker(args: tuple, kwargs: dict, worker: int | None) -> tuple[tuple, dict]:
    """Each per-worker value replaced by worker `worker`'s, or, with None, by what
    a function is traced with (a dataset's or iterator's type spec, a built value)."""
    def pick(x):
        if not isinstance(x, PerWorker):
            return x
        return x.sample() if worker is None else x.value(worker)

    return tf.nest.map_structure(pick, (args, kwargs))


def refuse_variables(what: str):
    """A variable creator scope in which creating a `tf.Variable` raises ValueError.

    TF's coordinator refuses variables in a dataset function: the function runs
    once per worker, and a variable would be created on each (or on the ps
    tasks, shared by datasets that should not share state).
    """
    def refuse(next_creator, **kwargs):
        raise ValueError(
            f"Creating variables in {what} is not allowed (a tf.Variable named "
            f"{kwargs.get('name')!r} was being created): it runs on every worker. Create the "
            "variable outside it (in strategy.scope() for a ps variable) and use it there, "
            "or use strategy.create_per_worker_resource for per-worker state."
        )

    return tf.variable_creator_scope(refuse)


def per_worker_resource(fn: Callable[[], Any], num_workers: int, *,
                        is_up: Callable[[int], bool] | None = None) -> PerWorker:
    """`fn()` called on every worker's device (those out of rotation: when they rejoin)."""

    if not callable(fn):
        raise TypeError(
            f"Invalid value for argument `fn`. Received: fn={fn!r} of type "
            f"{type(fn).__name__}. Expected a function returning the worker's resource."
        )

    return PerWorker(_ResourceBuilder(fn), num_workers, getattr(fn, "__name__", "resource"), is_up=is_up)


class _ResourceBuilder:
    """`build(worker)`: `fn()` on the worker's device. A `tf.function` given as `fn` also has `remake()`:
    made anew from its Python code (`fresh_tf_function`), for a registration lost on its way
    (`until_registered`), which would otherwise fail that worker's value at every rebuild. A plain
    function is only called again: a `tf.function` it calls inside is not made anew."""

    def __init__(self, fn: Callable[[], Any]):
        self._fn = fn

    def __call__(self, worker: int):
        with tf.device(_runtime.worker_device(worker)), _runtime.worker_index_scope(worker):
            return self._fn()

    @property
    def remake(self) -> Callable[[], None] | None:
        if isinstance(self._fn, tf.types.experimental.PolymorphicFunction) and hasattr(self._fn, "python_function"):
            return self._made_anew
        return None

    def _made_anew(self) -> None:
        self._fn = fresh_tf_function(self._fn)


def dataset_cloner(dataset) -> Callable:
    """A dataset function that rebuilds `dataset` on whichever device is in force.

    A dataset made on the coordinator lives there: an iterator made from it
    under a worker's device would still read on the coordinator. So the
    dataset's graph is serialized once and re-created on each worker.
    """
    graph_def, spec = serialize_dataset(dataset), dataset.element_spec

    def clone(_input_context):
        return deserialize_dataset(graph_def, spec)

    return clone
