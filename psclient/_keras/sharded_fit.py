"""`model.fit(sharded_dataset)`: an epoch is every shard of a `psclient.data.ShardedDataset` once.

Keras's own loop runs (callbacks, progress bar, History); one Keras "step" is
one shard, so Keras's `steps_per_epoch` is the number of shards. Callbacks
(the progress bar too) count batches all the same, Keras's unit: the batches
of the shards finished so far in the epoch. When the batches of an epoch are
known beforehand (finite data of unknown size, which psclient counts) the bar
shows them from the first epoch; otherwise the first epoch's bar has no total
and the next ones have the first's, as Keras's bar has on data of unknown
size. Each call of the train function hands the ledger's next shard
to `strategy.schedule` (whichever worker is free takes it: late binding) and
returns the metrics of the latest finished shard without waiting; the
epoch's last call waits for every shard and runs again any the ledger still
misses, so Keras reads the epoch's metrics once every shard is done. The
ledger itself, and what happens when a worker dies mid-shard, is
`psclient._coordinator.data.shard_feed`. `psclient.BackupAndRestore` saves the
ledger beside its backup and restores it (`active_feed`).
"""

from __future__ import annotations

import collections
import weakref

import tensorflow as tf

from psclient._coordinator.data.shard_feed import ShardFeed
from psclient._coordinator.data.shards import ShardedDataset
from psclient._keras.ps_reads import metrics_through_ps_loss, restore_cause
from psclient._keras.trainer import prepare_model, result_or_first_error
from psclient._tf.executors import streamed_function_registrations

__all__ = ["active_feed", "as_finite", "fit", "is_sharded"]

def is_sharded(x) -> bool:
    return isinstance(x, ShardedDataset)


def as_finite(x):
    """evaluate/predict data: a ShardedDataset as one finite dataset, every shard in list order."""
    return x.as_dataset() if is_sharded(x) else x


def active_feed(model) -> ShardFeed | None:
    """The feed of `model`'s running `fit` on a ShardedDataset (its train function's), or None."""
    train_function = getattr(model, "train_function", None)
    return train_function.feed if isinstance(train_function, ShardTrainFunction) else None


def _feed(model, strategy, sharded: ShardedDataset) -> ShardFeed:
    """The feed of (model, sharded dataset), one per strategy: its ps variables are made once."""
    return strategy.parts.ledgers.feed_for(model, sharded, lambda: ShardFeed(strategy, sharded))


def _steps_per_execution(model) -> int:
    value = getattr(model, "steps_per_execution", 1)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"Invalid value for argument `steps_per_execution`. Received: steps_per_execution={value!r} "
            "with a psclient.data.ShardedDataset as `x`. Expected an integer >= 1 (batches per loop "
            "iteration of a shard, and shards per call of the train function)."
        )
    return value


def _refuse(a: dict) -> None:
    for name in ("y", "sample_weight", "class_weight", "batch_size", "steps_per_epoch"):
        if a.get(name) is not None:
            raise ValueError(
                f"Invalid value for argument `{name}`. Received: {name}={a[name]!r} with a "
                f"psclient.data.ShardedDataset as `x`. Expected None: an epoch is every shard once, "
                "and make_dataset's batches carry targets and weights."
            )
    if a.get("validation_split"):
        raise ValueError(
            f"Invalid value for argument `validation_split`. Received: validation_split="
            f"{a['validation_split']!r} with a psclient.data.ShardedDataset as `x`. Expected 0: "
            "pass validation_data instead."
        )


class ShardTrainFunction:
    """What Keras's fit calls once per step: one shard per call (module doc)."""

    def __init__(self, model, strategy, feed: ShardFeed):
        self._strategy = strategy
        self._feed = self.feed = feed  # `feed`: for BackupAndRestore (`active_feed`)
        self._model_ref = model_ref = weakref.ref(model)

        def step(batch):
            model_ref().train_step(batch)

        def results():
            return model_ref().get_metrics_result()

        step.__name__ = f"{model.name}_train_step"
        # steps_per_execution=N: Keras calls once per N of its steps (shards here), and the
        # shard loop trains N batches between two ledger writes (shard_feed's module doc).
        self._per_call = _steps_per_execution(model)
        self._function = feed.shard_function(step, result_fn=results, name=f"{model.name}_train_shard",
                                             steps_per_iteration=self._per_call)
        self._in_flight: collections.OrderedDict = collections.OrderedDict()
        self._latest = None
        self._calls = 0
        self._batches: dict[int, int] = {}  # slot -> batches of the shard, for the shards finished this epoch
        self._max_in_flight = max(2, 2 * strategy.num_workers * strategy.pipeline_depth)

    @property
    def steps(self) -> int:
        return len(self._feed.sharded.shards)

    def begin_epoch(self, epoch: int) -> None:
        self._feed.start_epoch(epoch)
        self._calls = 0
        self._batches = {}

    def batch_index(self, step: int, end: bool) -> int:
        """The batch index callbacks get at the beginning or `end` of Keras's `step` (a shard call):
        the batches of the shards finished this epoch, the last of them at the end."""
        done = sum(self._batches.values())
        return max(done - 1, 0) if end else done

    def __call__(self, iterator):
        self._calls += 1
        for _ in range(self._per_call):
            work = self._feed.hand_out()
            if work is not None:
                self._in_flight[self._strategy.schedule(self._function, args=work.args)] = work
        if self._calls * self._per_call >= self.steps:
            return self.finish()
        while len(self._in_flight) > self._max_in_flight or (self._latest is None and self._in_flight):
            self._settle(next(iter(self._in_flight)))
        for future in [f for f in self._in_flight if f.done()]:
            self._settle(future)
        return self._latest or {}

    def finish(self):
        """Wait for every shard of the epoch; run any the ledger still misses (unless a
        callback stopped training: then only wait for the shards in flight)."""
        model = self._model_ref()
        stopping = model is not None and model.stop_training
        while True:
            while not stopping and (work := self._feed.hand_out()) is not None:
                self._in_flight[self._strategy.schedule(self._function, args=work.args)] = work
            if not self._in_flight:
                break
            self._settle(next(iter(self._in_flight)))
        self._strategy.join()
        return self._latest or {}

    def abandon(self) -> None:
        """After an error: give back what is pending, wait for the rest, log nothing new."""
        pending, self._in_flight = self._in_flight, collections.OrderedDict()
        for future in pending:
            future.cancel()
        for future, work in pending.items():
            try:
                result = future.result()
            except Exception:  # noqa: BLE001 - cancelled or failed: the shard goes back either way
                self._feed.give_back(work)
            else:
                self._feed.mark_done(work, result)
        try:
            self._strategy.join()
        except Exception:  # noqa: BLE001 - the error being raised matters more
            pass

    def _settle(self, future) -> None:
        work = self._in_flight.pop(future)
        result = result_or_first_error(self._strategy, future, self.abandon)
        self._feed.mark_done(work, result)
        self._batches[work.slot] = int(result["position"])  # the shard's batches: it ended there
        self._latest = result["result"]


def fit(stock, model, strategy, a: dict, forwarded: dict, make_callbacks, batches: int | None = None):
    """Keras's fit over `a["x"]`, a ShardedDataset (module doc); `batches`: an epoch's, if known.

    `make_callbacks(train_function, callbacks, steps, batch_index)` makes fit's callback list.
    """
    import keras

    sharded = a["x"]
    _refuse(a)
    prepare_model(model, strategy, sharded.element_spec, "fit")
    feed = _feed(model, strategy, sharded)
    resume = feed.resume_epoch(forget=True)  # a ledger from strategy.restore(): its epoch goes on
    if resume is not None and not forwarded.get("initial_epoch"):
        forwarded = dict(forwarded, initial_epoch=resume)
    train_function = ShardTrainFunction(model, strategy, feed)

    class _Epochs(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            train_function.begin_epoch(epoch)

    previous = model.train_function
    model.train_function = train_function
    callbacks = list(forwarded.get("callbacks") or [])
    if isinstance(forwarded.get("callbacks"), keras.callbacks.CallbackList):
        raise ValueError("Invalid value for argument `callbacks`. Received: a CallbackList with a "
                         "psclient.data.ShardedDataset as `x`. Expected a list of callbacks.")
    forwarded = dict(forwarded, callbacks=make_callbacks(train_function, callbacks + [_Epochs()], batches,
                                                         train_function.batch_index))
    ok = False
    try:
        # An endless stand-in for the data: each step's shard comes from the ledger.
        # As in psclient's fit (psclient/_keras/install.py): metric reads through a ps loss,
        # Keras's own traces registered without waiting on a hung worker.
        with metrics_through_ps_loss(model, strategy), streamed_function_registrations():
            history = stock(model, x=_Steps(sharded), batch_size=None,
                            validation_data=as_finite(a["validation_data"]),
                            shuffle=False, steps_per_epoch=train_function.steps, **forwarded)
        ok = True
        return history
    except Exception as error:
        restore_cause(error)
        raise
    finally:
        if not ok:
            train_function.abandon()
        model.train_function = previous


def _Steps(sharded):
    """A Keras data adapter that never runs out and whose iterator is not read (the ledger feeds the steps)."""
    from keras.src.trainers.data_adapters.data_adapter import DataAdapter

    class _Forever(tf.distribute.DistributedDataset):  # Keras passes a DistributedDataset through
        def __init__(self):
            pass

        def __iter__(self):
            return self

        def __next__(self):
            return None

        @property
        def element_spec(self):
            return sharded.element_spec

    class ShardSteps(DataAdapter):
        num_batches = None
        batch_size = None
        has_partial_batch = None
        partial_batch_size = None

        def get_tf_dataset(self):
            return _Forever()

        @property
        def element_spec(self):
            return sharded.element_spec

    return ShardSteps()
