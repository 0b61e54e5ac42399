"""Code written for TF's ClusterCoordinator runs on psclient.

This is the custom-training-loop part of TF's parameter-server tutorial, with
Keras 3 layers, changed only in the import and the strategy constructor.
"""

import numpy as np
import pytest
import tensorflow as tf

import psclient

keras = pytest.importorskip("keras")
pytestmark = pytest.mark.cluster


def test_tutorial_custom_loop(strategy):
    coordinator = psclient.ClusterCoordinator(strategy)
    global_batch_size = 64
    rng = np.random.default_rng(0)
    features = rng.normal(size=(1024, 10)).astype("float32")
    labels = (features[:, :1] + features[:, 1:2] > 0).astype("float32")

    def dataset_fn(input_context):
        batch_size = input_context.get_per_replica_batch_size(global_batch_size)
        dataset = tf.data.Dataset.from_tensor_slices((features, labels)).repeat()
        dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        return dataset.batch(batch_size).prefetch(2)

    @tf.function
    def per_worker_dataset_fn():
        return strategy.distribute_datasets_from_function(dataset_fn)

    with strategy.scope():
        model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(1, activation="sigmoid")])
        optimizer = keras.optimizers.RMSprop(learning_rate=0.05)
        accuracy = keras.metrics.BinaryAccuracy()
        optimizer.build(model.trainable_variables)

    @tf.function
    def step_fn(iterator):
        def replica_fn(batch_data, labels):
            with tf.GradientTape() as tape:
                pred = model(batch_data, training=True)
                per_example_loss = keras.losses.binary_crossentropy(labels, pred)
                loss = tf.nn.compute_average_loss(per_example_loss)
            gradients = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(gradients, model.trainable_variables))
            accuracy.update_state(labels, pred)
            return loss

        batch_data, labels = next(iterator)
        losses = strategy.run(replica_fn, args=(batch_data, labels))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    per_worker_dataset = coordinator.create_per_worker_dataset(per_worker_dataset_fn)
    per_worker_iterator = iter(per_worker_dataset)

    num_epochs, steps_per_epoch = 4, 10
    for _ in range(num_epochs):
        accuracy.reset_state()
        for _ in range(steps_per_epoch):
            coordinator.schedule(step_fn, args=(per_worker_iterator,))
        coordinator.join()
    loss = coordinator.schedule(step_fn, args=(per_worker_iterator,))
    assert coordinator.done() in (True, False)
    final = coordinator.fetch(loss)
    assert loss.fetch() == final
    assert np.isfinite(final)
    assert accuracy.result().numpy() > 0.8
    assert int(optimizer.iterations.numpy()) == num_epochs * steps_per_epoch + 1


def test_per_worker_resources_and_fetch_of_structures(strategy):
    coordinator = psclient.ClusterCoordinator(strategy)
    tables = coordinator.create_per_worker_resources(
        lambda: tf.lookup.StaticHashTable(
            tf.lookup.KeyValueTensorInitializer(tf.constant(["a", "b"]), tf.constant([1, 2], tf.int64)), -1
        )
    )

    @tf.function
    def look(table, key):
        return table.lookup(key)

    futures = {k: coordinator.schedule(look, args=(tables, tf.constant(k))) for k in ["a", "b", "z"]}
    coordinator.join()
    assert coordinator.fetch(futures) == {"a": 1, "b": 2, "z": -1}


def test_one_coordinator_per_strategy_as_tfs_held_by_the_strategy_weakly(strategy):
    import gc
    import weakref

    first = psclient.ClusterCoordinator(strategy)
    assert psclient.ClusterCoordinator(strategy) is first  # a second call returns the first
    gone = weakref.ref(first)
    del first
    gc.collect()
    assert gone() is None  # the strategy does not keep its coordinator alive
    assert psclient.ClusterCoordinator(strategy).strategy is strategy  # and a new one can be made


def test_coordinator_rejects_tf_strategy():
    with pytest.raises(TypeError, match="strategy"):
        psclient.ClusterCoordinator(object())


def test_keras_counters_and_metrics_lose_no_concurrent_updates(strategy):
    with strategy.scope():
        total = keras.metrics.Sum()
        counter = keras.Variable(0, dtype="int64", trainable=False)

    @tf.function
    def update():
        total.update_state(1.0)
        counter.assign_add(1)
        return counter.value

    futures = [strategy.schedule(update) for _ in range(300)]
    strategy.join()
    assert all(f.done() for f in futures)
    # Both workers updated the same ps variables at once; nothing was lost.
    assert total.result().numpy() == 300.0
    assert int(counter.numpy()) == 300
