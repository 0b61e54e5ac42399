"""Child process of `test_keras_fit_starts_while_a_worker_hangs`: Keras fit (with validation),
evaluate and predict, each started while a worker is SIGSTOPped; prints one JSON line.

Then `model.get_weights()`. `child HANG_TIMEOUT arrays`: numpy arrays made after the strategy,
Keras's EarlyStopping keeping the best weights and ReduceLROnPlateau. `child HANG_TIMEOUT datasets`:
as published scripts run, `tf.data` datasets built first, before the cluster and the strategy,
`fit` without `steps_per_epoch`, and Keras's TensorBoard callback in fit and evaluate (the tags
it wrote are printed too); `unknown_size`: a training dataset whose size TF cannot tell (a
`filter`), no callback; `python`: data made in Python, built first (a `from_generator`
dataset to train on, a `keras.utils.PyDataset` to validate and evaluate, a generator to
predict), read on the coordinator.

A process of its own: what waited for the hung worker were ops and functions of kinds the
process had not run yet (TF registers each new kind on every task), which earlier tests in
the suite's process would already have registered.
"""

import json
import os
import sys
import tempfile
import time

import keras
import numpy as np
import tensorflow as tf
from _heartbeat import Heartbeat
from _stopped import is_stopped, resume_later

import psclient

#: How long the worker stays stopped at most (then the watchdog resumes it).
WATCHDOG_S = 120


def _data():
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    return x, x.sum(axis=1, keepdims=True)


def _calls(model, mode: str, data):
    """(name, call) of fit, evaluate, predict and get_weights on `data`: arrays, or datasets made before."""
    weights = ("get_weights", lambda: [w.shape for w in model.get_weights()])  # each variable's numpy()
    if mode == "arrays":
        x, y = data
        # EarlyStopping keeps the best weights (get_weights) and sets them back at the end;
        # ReduceLROnPlateau reads the learning rate on the ps.
        stopping = [keras.callbacks.EarlyStopping(patience=5, restore_best_weights=True),
                    keras.callbacks.ReduceLROnPlateau(patience=1)]
        return [("fit", lambda: model.fit(x, y, batch_size=8, epochs=2, steps_per_epoch=8,
                                          validation_data=(x, y), verbose=0, callbacks=stopping).history),
                ("evaluate", lambda: model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)),
                ("predict", lambda: model.predict(x, batch_size=8, verbose=0).shape), weights]
    train, validation, features, log_dir = data
    if mode == "python":
        return [("fit", lambda: model.fit(train, epochs=2, validation_data=validation, verbose=0).history),
                ("evaluate", lambda: model.evaluate(validation, verbose=0, return_dict=True)),
                ("predict", lambda: model.predict(features(), verbose=0).shape), weights]
    callbacks = []
    if mode == "datasets":  # and Keras's TensorBoard callback, writing steps per second too
        callbacks = [keras.callbacks.TensorBoard(log_dir, write_steps_per_second=True)]
    return [("fit", lambda: model.fit(train, epochs=2, validation_data=validation, verbose=0,
                                      callbacks=callbacks).history),
            ("evaluate", lambda: model.evaluate(validation, verbose=0, return_dict=True, callbacks=callbacks)),
            ("predict", lambda: model.predict(features, verbose=0).shape), weights]


def _python_data(x, y):
    """(from_generator training dataset, PyDataset, generator function of the features, None)."""
    def rows():
        yield from zip(x, y)

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return len(x) // 8

        def __getitem__(self, index):
            return x[index * 8:(index + 1) * 8], y[index * 8:(index + 1) * 8]

    def features():
        for i in range(0, len(x), 8):
            yield (x[i:i + 8],)

    spec = (tf.TensorSpec((4,), tf.float32), tf.TensorSpec((1,), tf.float32))
    return tf.data.Dataset.from_generator(rows, output_signature=spec).batch(8), Batches(), features, None


def _summary_tags(log_dir: str) -> dict:
    """{run directory: sorted tags} of the TensorBoard event files under `log_dir`."""
    tags = {}
    for directory, _, files in os.walk(log_dir):
        for name in files:
            if name.startswith("events."):
                events = tf.compat.v1.train.summary_iterator(os.path.join(directory, name))
                found = {value.tag for event in events for value in event.summary.value}
                tags.setdefault(os.path.relpath(directory, log_dir), set()).update(found)
    return {run: sorted(found) for run, found in tags.items()}


def main() -> None:
    hang_timeout, mode = float(sys.argv[1]), sys.argv[2]
    data = _data()
    if mode == "python":  # made in Python, before anything of psclient
        data = _python_data(*data)
    elif mode != "arrays":  # before anything of psclient, as a published script builds its data
        x, y = data
        train = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(64, seed=0)
        if mode == "unknown_size":  # a filter: TF cannot tell its size (psclient counts its batches)
            train = train.filter(lambda features, target: tf.reduce_all(tf.math.is_finite(features)))
        data = (train.batch(8), tf.data.Dataset.from_tensor_slices((x, y)).batch(8),
                tf.data.Dataset.from_tensor_slices(x).batch(8), tempfile.mkdtemp(prefix="beside-hung-"))
    with psclient.LocalCluster(num_workers=3, num_ps=1) as cluster:
        strategy = psclient.ParameterServerStrategy(cluster.cluster, hang_timeout=hang_timeout)
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", metrics=["mae"])
        pid = cluster.pid("worker", 2)
        result = {}
        cluster.stop("worker", 2)
        stop_watchdog = resume_later(pid, WATCHDOG_S)
        try:
            with Heartbeat() as beat:
                for name, call in _calls(model, mode, data):
                    start = time.monotonic()
                    output = call()
                    result[name] = {"seconds": round(time.monotonic() - start, 2),
                                    "worker_still_stopped": is_stopped(pid), "output": str(output)}
            result["longest_stall_s"] = beat.longest
        finally:
            cluster.resume("worker", 2)
            stop_watchdog()
        result["iterations"] = int(model.optimizer.iterations.numpy())
        if mode == "datasets":
            result["summaries"] = _summary_tags(data[-1])
        strategy.shutdown()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
