"""TF's ClusterCoordinator contract, run through `psclient.ClusterCoordinator`.

Written from the documented behaviour of `tf.distribute.coordinator.
ClusterCoordinator` and TF's `ParameterServerStrategy` (their docstrings in
TF's cluster_coordinator.py and parameter_server_strategy_v2.py): one
coordinator per strategy, RemoteValue inputs refused, errors cleared once
raised, cross-replica context in scope, run/reduce inside scheduled functions,
per-worker variables, partitioned embedding lookups. The error rule's pure
part is tested on the scheduler alone first, without a cluster.
"""

import concurrent.futures
import logging
import threading

import numpy as np
import pytest

from psclient._core.future import Future
from psclient._core.closure import Closure
from psclient._core.scheduler import Scheduler


def _closure(name):
    return Closure(lambda: None, (), {}, Future(name))


# ------------------------------------------------------- the error rule, pure
def test_raising_an_error_clears_the_errors_of_closures_that_were_running():
    """TF: schedule/join/done raise one error and clear those collected so far."""
    s = Scheduler(num_workers=2)
    a, b, queued = _closure("a"), _closure("b"), _closure("queued")
    for c in (a, b, queued):
        s.submit(c)
    assert s.take(0, timeout=0) is a
    assert s.take(1, timeout=0) is b
    s.failed(0, a, ValueError("a failed"), retry=False)
    assert queued.future.cancelled()

    raised = []

    def schedule_more():
        try:
            s.submit(_closure("next"))
        except ValueError as error:
            raised.append(error)

    # schedule() waits for `b` (still running) before it raises...
    t = threading.Thread(target=schedule_more)
    t.start()
    t.join(0.2)
    assert t.is_alive(), "submit() raised while a closure was still running"
    s.failed(1, b, ValueError("b failed too"), retry=False)
    t.join(10)
    assert not t.is_alive()
    assert [str(e) for e in raised] == ["a failed"]
    # ...and b's error was cleared with a's: the next join() raises nothing.
    assert s.join(timeout=5) is True
    assert isinstance(b.future.exception(timeout=0), ValueError)


def test_a_retry_while_an_error_is_pending_is_cancelled_not_run_again():
    s = Scheduler(num_workers=2)
    a, b = _closure("a"), _closure("b")
    s.submit(a)
    s.submit(b)
    s.take(0, timeout=0)
    s.take(1, timeout=0)
    s.failed(0, a, RuntimeError("boom"), retry=False)
    s.failed(1, b, ConnectionError("transient"), retry=True)
    with pytest.raises(concurrent.futures.CancelledError):
        b.future.result(timeout=0)
    assert s.take(1, timeout=0) is None
    with pytest.raises(RuntimeError, match="boom"):
        s.done()
    assert s.done() is True


def test_a_lost_workers_closures_are_cancelled_while_an_error_is_pending():
    s = Scheduler(num_workers=2)
    a, b = _closure("a"), _closure("b")
    s.submit(a)
    s.submit(b)
    s.take(0, timeout=0)
    s.take(1, timeout=0)
    s.failed(0, a, RuntimeError("boom"), retry=False)
    assert s.worker_lost(1) == []
    assert b.future.exception(timeout=0) is not None or b.future.cancelled()
    with pytest.raises(RuntimeError, match="boom"):
        s.join(timeout=5)
    assert s.join(timeout=5) is True


# ------------------------------------------------------------- on a cluster
tf = pytest.importorskip("tensorflow")
import psclient  # noqa: E402

NUM_PS = 2


@pytest.fixture(scope="module")
def strategy(two_workers_two_ps):
    """2 workers + 2 ps and the TF tutorial's partitioner (the shared 2 + 2
    cluster: `local_cluster` has one ps, so nothing would be sharded)."""
    assert two_workers_two_ps.cluster.num_ps == NUM_PS
    partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=256 << 10, max_shards=NUM_PS
    )
    s = psclient.ParameterServerStrategy(two_workers_two_ps.cluster, variable_partitioner=partitioner)
    try:
        yield s
    finally:
        s.shutdown()


@pytest.mark.cluster
def test_a_strategy_has_one_coordinator(strategy):
    first = psclient.ClusterCoordinator(strategy)
    assert psclient.ClusterCoordinator(strategy) is first
    assert psclient.ClusterCoordinator(strategy=strategy) is first
    assert first.strategy is strategy


@pytest.mark.cluster
def test_a_future_as_an_input_of_schedule_is_refused_at_once(strategy):
    coordinator = psclient.ClusterCoordinator(strategy)

    @tf.function
    def one():
        return tf.constant(1)

    @tf.function
    def plus_one(x):
        return x + 1

    first = coordinator.schedule(one)
    for kwargs in ({"args": (first,)}, {"kwargs": {"x": first}}, {"args": ([first],)}):
        with pytest.raises(ValueError, match=r"result of an earlier schedule\(\)"):
            coordinator.schedule(plus_one, **kwargs)
    coordinator.join()
    assert coordinator.schedule(plus_one, args=(first.result(),)).result(timeout=120) == 2


@pytest.mark.cluster
def test_an_error_raised_by_schedule_is_not_raised_again_by_join(strategy):
    coordinator = psclient.ClusterCoordinator(strategy)

    @tf.function
    def fails(x):
        tf.debugging.assert_equal(x, 2, message="deliberate failure")
        return x

    @tf.function
    def ok():
        return tf.constant(7)

    # The first failure is raised by a schedule(), done() or join(); only once. It can come from one
    # of the failing schedules themselves (a worker fails the first before the sixth is scheduled,
    # as on a loaded machine): no failing closure is scheduled after it, since its error is new.
    raised, failing = [], []

    def recording(call):
        try:
            return call()
        except tf.errors.InvalidArgumentError as error:
            raised.append(error)
            return None

    for _ in range(6):
        future = recording(lambda: coordinator.schedule(fails, args=(tf.constant(1),)))
        if future is None:
            break
        failing.append(future)
    for _ in range(2000):
        if raised:
            break
        recording(lambda: coordinator.schedule(ok))
        recording(coordinator.done)
    if not raised:
        recording(coordinator.join)
    assert len(raised) == 1 and "deliberate failure" in str(raised[0])
    coordinator.join()  # the other failures were cleared with the first
    assert coordinator.done() is True
    for future in failing:
        assert future.done()
    assert coordinator.schedule(ok).result(timeout=120) == 7
    coordinator.join()


@pytest.mark.cluster
def test_cross_replica_context_in_scope_and_run_reduce_in_a_scheduled_function(strategy, caplog):
    coordinator = psclient.ClusterCoordinator(strategy)
    assert not tf.distribute.in_cross_replica_context()
    contexts = []
    with strategy.scope():
        assert tf.distribute.in_cross_replica_context()
        assert tf.distribute.get_replica_context() is None
        v = tf.Variable(1.0)
        counter = tf.Variable(0.0, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        summed = tf.Variable(1.0, aggregation=tf.VariableAggregation.SUM)

        @tf.function
        def step(x):
            contexts.append(("step", tf.distribute.in_cross_replica_context()))

            def replica_fn(x):
                contexts.append(("replica", tf.distribute.in_cross_replica_context()))
                ctx = tf.distribute.get_replica_context()
                summed.assign(tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32))
                counter.assign_add(x)
                return x + v, x - v

            per_replica = strategy.run(replica_fn, args=(x,))
            return strategy.reduce("SUM", per_replica, axis=None)

        with caplog.at_level(logging.WARNING, logger="psclient"):
            inside = coordinator.schedule(step, args=(tf.constant(3.0),))
            assert inside.fetch() == (4.0, 2.0)
    assert not tf.distribute.in_cross_replica_context()
    outside = coordinator.schedule(step, args=(tf.constant(3.0),))
    assert coordinator.fetch(outside) == (4.0, 2.0)
    coordinator.join()
    # One replica per call: ONLY_FIRST_REPLICA and SUM aggregate one value each.
    assert counter.numpy() == 6.0
    assert summed.numpy() == strategy.num_replicas_in_sync == 1
    assert ("step", True) in contexts and ("replica", False) in contexts
    assert ("replica", True) not in contexts
    # Traced by schedule(): no warning about running on the coordinator.
    assert not [r for r in caplog.records if "without using `ClusterCoordinator.schedule`" in r.message]


@pytest.mark.cluster
def test_run_and_reduce_outside_schedule_warn_as_tf_does(strategy, caplog):
    with caplog.at_level(logging.WARNING, logger="psclient"):
        result = strategy.run(lambda x: x * 2, args=(tf.constant(2.0),))
        reduced = strategy.reduce(tf.distribute.ReduceOp.MEAN, result, axis=None)
    assert reduced.numpy() == 4.0
    warnings = [r.message for r in caplog.records if "without using `ClusterCoordinator.schedule`" in r.message]
    assert len(warnings) == 2 and "run()" in warnings[0] and "reduce()" in warnings[1]
    with pytest.raises(ValueError, match="reduce_op"):
        strategy.reduce("MAX", reduced)


@pytest.mark.cluster
def test_run_inside_scope_on_the_coordinator_is_a_replica_context(strategy):
    with strategy.scope():
        inside = strategy.run(lambda: tf.distribute.in_cross_replica_context())
        assert tf.distribute.in_cross_replica_context()
    assert inside is False


@pytest.mark.cluster
def test_per_worker_variable_is_a_documented_difference_with_the_psclient_way(strategy):
    with strategy.scope():
        with pytest.raises(ValueError, match="per_worker_variable.*create_per_worker_resource"):
            tf.Variable(0.0, per_worker_variable=True)
    coordinator = psclient.ClusterCoordinator(strategy)
    # The psclient way: one variable per worker, passed as an argument.
    counters = coordinator.create_per_worker_resources(lambda: tf.Variable(0.0))
    assert all("/job:worker/replica:0/task:%d" % i in v.device for i, v in enumerate(counters.values))

    @tf.function
    def count(counter):
        counter.assign_add(1.0)
        return counter.read_value()

    futures = [coordinator.schedule(count, args=(counters,)) for _ in range(20)]
    coordinator.join()
    read_all = [v.numpy() for v in counters.values]  # TF's PerWorkerVariable.read_all()
    assert sum(read_all) == 20.0
    assert max(f.result() for f in futures) == max(read_all)


@pytest.mark.cluster
def test_sharded_variable_embedding_lookup_in_a_scheduled_function(strategy):
    """TF's case: a variable the partitioner splits, looked up with tf.nn.embedding_lookup."""
    rows, width = 1024, 128  # 512 KiB: two shards of 256 KiB, one per ps
    table = np.arange(rows * width, dtype=np.float32).reshape(rows, width)
    with strategy.scope():
        v = tf.Variable(table)
    base = v.name.split(":")[0]
    shards = [p for p in strategy.placement()["variables"] if (p["of"] or "").split(":")[0] == base]
    assert len(shards) == NUM_PS
    assert sorted(p["ps_index"] for p in shards) == list(range(NUM_PS))
    coordinator = psclient.ClusterCoordinator(strategy)
    ids = tf.constant([0, 511, 512, 1023, 7, 700])

    @tf.function
    def lookup(ids):
        return tf.nn.embedding_lookup(v, ids)

    got = coordinator.fetch(coordinator.schedule(lookup, args=(ids,)))
    np.testing.assert_array_equal(got, table[ids.numpy()])
    np.testing.assert_array_equal(tf.nn.embedding_lookup(v, ids).numpy(), table[ids.numpy()])


@pytest.mark.cluster
def test_tf_tutorial_custom_training_loop(strategy):
    """TF's parameter-server tutorial, custom-loop part, with only psclient's imports.

    The program as published, with what Keras 3 itself renamed (TF 2.16+
    ships Keras 3 as tf.keras): `optimizers.RMSprop` for the removed
    `optimizers.legacy.RMSprop`, `reset_state()` for `reset_states()`,
    `reduction=None` for `Reduction.NONE`, `keras.ops.mean` for
    `tf.reduce_mean` on a symbolic Keras tensor, the lookup layers for the
    one-layer preprocessing models (Keras 3 refuses unbatched inputs to a
    functional model). The strategy is this module's,
    made as the tutorial makes it: `ParameterServerStrategy(cluster,
    variable_partitioner=MinSizePartitioner(256 KiB, NUM_PS))`.
    """
    import random

    rng = random.Random(0)
    feature_vocab = ["avenger", "ironman", "batman", "hulk", "spiderman", "kingkong", "wonder_woman"]
    label_vocab = ["yes", "no"]

    with strategy.scope():
        feature_lookup_layer = tf.keras.layers.StringLookup(vocabulary=feature_vocab, mask_token=None)
        label_lookup_layer = tf.keras.layers.StringLookup(
            vocabulary=label_vocab, num_oov_indices=0, mask_token=None
        )
        # Keras 3 functional models refuse the unbatched elements of a
        # dataset map: the tutorial's one-layer preprocessing models are
        # their layers here.
        feature_preprocess_stage = feature_lookup_layer
        label_preprocess_stage = label_lookup_layer

    def feature_and_label_gen(num_examples=200):
        examples = {"features": [], "label": []}
        for _ in range(num_examples):
            features = rng.sample(feature_vocab, 3)
            label = ["yes"] if "avenger" in features else ["no"]
            examples["features"].append(features)
            examples["label"].append(label)
        return examples

    examples = feature_and_label_gen()

    def dataset_fn(_):
        raw_dataset = tf.data.Dataset.from_tensor_slices(examples)
        train_dataset = raw_dataset.map(
            lambda x: ({"features": feature_preprocess_stage(x["features"])}, label_preprocess_stage(x["label"]))
        ).shuffle(200).batch(32).repeat()
        return train_dataset

    with strategy.scope():
        model_input = tf.keras.layers.Input(shape=(3,), dtype=tf.int64, name="model_input")
        emb_layer = tf.keras.layers.Embedding(
            input_dim=len(feature_lookup_layer.get_vocabulary()), output_dim=16384
        )
        emb_output = tf.keras.ops.mean(emb_layer(model_input), axis=1)
        dense_output = tf.keras.layers.Dense(
            units=1, activation="sigmoid", kernel_regularizer=tf.keras.regularizers.L2(1e-4)
        )(emb_output)
        model = tf.keras.Model({"features": model_input}, dense_output)
        optimizer = tf.keras.optimizers.RMSprop(learning_rate=0.1)
        accuracy = tf.keras.metrics.Accuracy()

    # The tutorial checks the embedding is split in two; with Keras 3 the
    # layer keeps one variable, and psclient reports its shards.
    embedding = emb_layer.embeddings.path.split(":")[0]
    shards = [p for p in strategy.placement()["variables"] if embedding in (p["of"] or "")]
    assert [p["shape"] for p in shards] == [[4, 16384], [4, 16384]] or [
        tuple(p["shape"]) for p in shards] == [(4, 16384), (4, 16384)]

    @tf.function
    def step_fn(iterator):
        def replica_fn(batch_data, labels):
            with tf.GradientTape() as tape:
                pred = model(batch_data, training=True)
                per_example_loss = tf.keras.losses.BinaryCrossentropy(reduction=None)(labels, pred)
                loss = tf.nn.compute_average_loss(per_example_loss)
                model_losses = model.losses
                if model_losses:
                    loss += tf.nn.scale_regularization_loss(tf.add_n(model_losses))
            gradients = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(gradients, model.trainable_variables))
            actual_pred = tf.cast(tf.greater(pred, 0.5), tf.int64)
            accuracy.update_state(labels, actual_pred)
            return loss

        batch_data, labels = next(iterator)
        losses = strategy.run(replica_fn, args=(batch_data, labels))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    coordinator = psclient.ClusterCoordinator(strategy)

    @tf.function
    def per_worker_dataset_fn():
        return strategy.distribute_datasets_from_function(dataset_fn)

    per_worker_dataset = coordinator.create_per_worker_dataset(per_worker_dataset_fn)
    per_worker_iterator = iter(per_worker_dataset)

    num_epochs = 4
    steps_per_epoch = 5
    for _ in range(num_epochs):
        accuracy.reset_state()
        for _ in range(steps_per_epoch):
            coordinator.schedule(step_fn, args=(per_worker_iterator,))
        coordinator.join()
    loss = coordinator.schedule(step_fn, args=(per_worker_iterator,))
    assert np.isfinite(loss.fetch())

    # Evaluation on the coordinator.
    eval_dataset = tf.data.Dataset.from_tensor_slices(feature_and_label_gen(num_examples=16)).map(
        lambda x: ({"features": feature_preprocess_stage(x["features"])}, label_preprocess_stage(x["label"]))
    ).batch(8)
    eval_accuracy = tf.keras.metrics.Accuracy()
    for batch_data, labels in eval_dataset:
        pred = model(batch_data, training=False)
        actual_pred = tf.cast(tf.greater(pred, 0.5), tf.int64)
        eval_accuracy.update_state(labels, actual_pred)
    local_accuracy = float(eval_accuracy.result())

    # Distributed evaluation.
    with strategy.scope():
        eval_accuracy = tf.keras.metrics.Accuracy()

    @tf.function
    def eval_step(iterator):
        def replica_fn(batch_data, labels):
            pred = model(batch_data, training=False)
            actual_pred = tf.cast(tf.greater(pred, 0.5), tf.int64)
            eval_accuracy.update_state(labels, actual_pred)

        batch_data, labels = next(iterator)
        strategy.run(replica_fn, args=(batch_data, labels))

    def eval_dataset_fn():
        return tf.data.Dataset.from_tensor_slices(feature_and_label_gen(num_examples=16)).map(
            lambda x: ({"features": feature_preprocess_stage(x["features"])}, label_preprocess_stage(x["label"]))
        ).shuffle(16).repeat().batch(8)

    per_worker_eval_dataset = coordinator.create_per_worker_dataset(eval_dataset_fn)
    per_worker_eval_iterator = iter(per_worker_eval_dataset)
    eval_steps_per_epoch = 2
    for _ in range(eval_steps_per_epoch):
        coordinator.schedule(eval_step, args=(per_worker_eval_iterator,))
    coordinator.join()

    # The labels are a function of the features ("avenger" in them): learnt.
    assert int(optimizer.iterations.numpy()) == num_epochs * steps_per_epoch + 1
    assert local_accuracy >= 0.75
    assert float(eval_accuracy.result()) >= 0.75
