"""fit, evaluate and predict on data made in the coordinator's Python: `Dataset.from_generator`,
generators and `keras.utils.PyDataset`, read once per epoch on the coordinator (host_data.py)."""

import math
import threading

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

pytestmark = pytest.mark.timeout(300)

_RNG = np.random.default_rng(0)
X = _RNG.normal(size=(640, 4)).astype("float32")
Y = X.sum(axis=1, keepdims=True).astype("float32")


class Reads:
    """A generator function over (X, Y) that counts the elements it yields, and in which thread."""

    def __init__(self, rows=len(X)):
        self.rows, self.count, self.threads = rows, 0, set()
        self._lock = threading.Lock()

    def __call__(self):
        for i in range(self.rows):
            with self._lock:
                self.count += 1
                self.threads.add(threading.get_ident())
            yield X[i], Y[i]

    def dataset(self, batch):
        spec = (tf.TensorSpec((4,), tf.float32), tf.TensorSpec((1,), tf.float32))
        return tf.data.Dataset.from_generator(self, output_signature=spec).batch(batch)


class Batches(keras.utils.PyDataset):
    """keras.utils.PyDataset of (X, Y) in batches of 50 (the last one 40)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.items = 0

    def __len__(self):
        return math.ceil(len(X) / 50)

    def __getitem__(self, index):
        self.items += 1
        return X[index * 50:(index + 1) * 50], Y[index * 50:(index + 1) * 50]


def make_model(strategy, steps_per_execution=1, learning_rate=0.05):
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(learning_rate), loss="mse", metrics=["mae"],
                      steps_per_execution=steps_per_execution)
    return model


@pytest.mark.parametrize("steps_per_execution", [1, 3])
def test_a_from_generator_dataset_is_read_once_an_epoch_on_the_coordinator(strategy, steps_per_execution):
    # 640 rows in batches of 32: 20 steps an epoch, the size unknown to TF. Read by the workers'
    # copies, a range of it each, the generator ran 3,296 times an epoch (each range read it from
    # its start, through calls back into this process).
    reads = Reads()
    model = make_model(strategy, steps_per_execution)
    history = model.fit(reads.dataset(32), epochs=3, verbose=0)
    assert reads.count == 3 * len(X)
    assert int(model.optimizer.iterations.numpy()) == 3 * 20
    losses = history.history["loss"]
    assert len(losses) == 3 and losses[-1] < 0.05 * losses[0]
    assert all(device.startswith("/job:ps/") for device in
               {v._value.device for v in model.variables + model.optimizer.variables})


def test_a_pydataset_trains_validates_and_evaluates_each_batch_once(strategy):
    model = make_model(strategy)
    train, validation = Batches(), Batches()
    history = model.fit(train, epochs=2, validation_data=validation, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 2 * 13
    # Each batch made once an epoch, as local Keras makes it (its adapter also looks at one
    # batch for the data's structure: counted the same way here).
    local = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    local.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    local_train, local_validation = Batches(), Batches()
    local.fit(local_train, epochs=2, validation_data=local_validation, verbose=0)
    assert (train.items, validation.items) == (local_train.items, local_validation.items)
    assert 2 * 13 <= train.items <= 2 * 13 + 2
    assert sorted(history.history) == ["loss", "mae", "val_loss", "val_mae"]
    # Every example once: the same figures as the arrays' (the same weights, read twice).
    from_pydataset = model.evaluate(Batches(), verbose=0, return_dict=True)
    from_arrays = model.evaluate(X, Y, batch_size=50, verbose=0, return_dict=True)
    assert from_pydataset == pytest.approx(from_arrays, rel=1e-5)


def test_a_generator_with_steps_per_epoch_loses_no_batch_between_epochs(strategy):
    given = []

    def batches():
        for i in range(0, 20 * 32, 32):
            given.append(i)
            yield X[i:i + 32], Y[i:i + 32]

    model = make_model(strategy)
    model.fit(batches(), epochs=2, steps_per_epoch=10, verbose=0)
    # Exactly the 20 batches, each once: the reads ahead of an epoch's end carry over.
    assert int(model.optimizer.iterations.numpy()) == 20
    assert given == list(range(0, 20 * 32, 32))


def test_predict_on_a_generator_is_in_input_order(strategy):
    model = make_model(strategy)

    def inputs():
        for i in range(0, len(X), 64):
            yield (X[i:i + 64],)  # Keras wants a tuple from a generator

    np.testing.assert_allclose(model.predict(inputs(), verbose=0), model.predict(X, batch_size=64, verbose=0),
                               rtol=1e-6)


def test_a_worker_killed_mid_fit_loses_no_batch_of_a_generator(strategy, local_cluster, restore_shared_clusters):
    # lr 0: the weights stay, so each step's loss is its batch's; the loss tracker counts
    # examples, so the epoch's count says every batch was trained (a re-run batch counts once:
    # a future resolves once).
    reads = Reads()
    model = make_model(strategy, learning_rate=0.0)
    killed = threading.Event()

    class KillWorker(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 5 and not killed.is_set():
                killed.set()
                local_cluster.kill("worker", 1)

    model.fit(reads.dataset(32), epochs=2, verbose=0, callbacks=[KillWorker()])
    assert killed.is_set()
    assert reads.count == 2 * len(X)
    assert int(model.optimizer.iterations.numpy()) >= 2 * 20
    # The last epoch's loss over every example once, whichever worker ran each batch.
    count = [v for v in model.metrics_variables if v.path.endswith("count")]
    assert count and float(count[0].numpy()) == len(X)
