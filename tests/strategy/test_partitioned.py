"""Partitioned variables on a real cluster (2 workers, 2 ps): Keras 3 models unchanged.

The fit comparisons run on a second cluster with one worker (fit on two is
asynchronous, so its order of steps is not a local run's); the custom loop
joins after every step, so two workers give the local order.

Weights are compared with a local Keras run of the same model, initial
weights and batches. Tolerance: 1e-5 absolute (float32; the sharded run
concatenates shards and splits updates, which reorders no arithmetic, so the
runs observed agree to 0.0).
"""

import contextlib

import numpy as np
import pytest
import tensorflow as tf

import psclient
from psclient._core.partitioning import PartitionError

keras = pytest.importorskip("keras")
pytestmark = pytest.mark.cluster

ATOL = 1e-5
partitioners = tf.distribute.experimental.partitioners


@pytest.fixture(scope="module")
def local(two_workers_two_ps):
    return two_workers_two_ps


@pytest.fixture(scope="module")
def cluster(local):
    return local.cluster


@pytest.fixture(scope="module")
def one_worker_cluster(one_worker_two_ps):
    """For fit runs compared with local Keras: one worker gives the local order of steps.

    A cluster of its own shape: a strategy on a subset of another cluster's
    workers would leave TF's device filters of the first connection in force.
    """
    return one_worker_two_ps.cluster


@contextlib.contextmanager
def connected(cluster, **kwargs):
    strategy = psclient.ParameterServerStrategy(cluster, **kwargs)
    try:
        yield strategy
    finally:
        strategy.shutdown()


def ps_of(device):
    assert "/job:ps/" in device, device
    return int(device.split("/task:")[1].split("/")[0])


def shard_tasks(variable):
    value = variable.value if isinstance(variable, keras.Variable) else variable
    return [ps_of(shard.device) for shard in getattr(value, "variables", [value])]


def build_model(seed=1, rows=65):  # 65 rows: shards of 33 and 32
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,), dtype="int32")
    x = keras.layers.Embedding(rows, 8)(inputs)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(32, activation="relu")(x)
    return keras.Model(inputs, keras.layers.Dense(3)(x))


OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "sgd_nesterov": lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5),
    "lion": lambda: keras.optimizers.Lion(0.001),
    "ftrl": lambda: keras.optimizers.Ftrl(0.1, l1_regularization_strength=0.01),
    "nadam": lambda: keras.optimizers.Nadam(0.01),
    "adafactor": lambda: keras.optimizers.Adafactor(0.01),  # not split: its slots are factored
}


def make_optimizer(name):
    return OPTIMIZERS[name]()


def compile_model(model, optimizer):
    model.compile(optimizer=make_optimizer(optimizer),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def data(rows=65):
    rng = np.random.default_rng(0)
    return rng.integers(0, rows, (64, 4)).astype("int32"), rng.integers(0, 3, (64,)).astype("int64")


def local_weights(optimizer, epochs=2):
    x, y = data()
    model = build_model()
    compile_model(model, optimizer)
    model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
    return [w.numpy() for w in model.weights]


def assert_close(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", sorted(set(OPTIMIZERS) - {"sgd"}))
def test_custom_loop_matches_local_keras(cluster, name):
    x, y = data()
    with connected(cluster, variable_partitioner=partitioners.FixedShardsPartitioner(2)) as strategy:
        with strategy.scope():
            model = build_model()
            optimizer = make_optimizer(name)
            optimizer.build(model.trainable_variables)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

        @tf.function
        def step(features, labels):
            with tf.GradientTape() as tape:
                loss = loss_fn(labels, model(features, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        for _epoch in range(2):
            for start in range(0, 64, 16):
                # One step at a time (join): the order of a local run, on either worker.
                strategy.schedule(step, args=(x[start:start + 16], y[start:start + 16]))
                strategy.join()
        if name == "adam":
            # Optimizer slots are partitioned like their variable, shard by shard on the same ps.
            for variable, m, v in zip(model.trainable_variables, optimizer._momentums, optimizer._velocities):
                assert shard_tasks(m) == shard_tasks(v) == shard_tasks(variable), variable.path
        got = [w.numpy() for w in model.weights]
    assert_close(got, local_weights(name))


@pytest.mark.parametrize("name", ["adam", "adagrad", "adafactor"])
def test_update_of_each_shard_runs_on_its_ps(cluster, name):
    """Every op that touches a slot's shard is placed on that shard's ps: slots never travel."""
    x, y = data()
    with connected(cluster, variable_partitioner=partitioners.FixedShardsPartitioner(2)) as strategy:
        with strategy.scope():
            model = build_model()
            optimizer = make_optimizer(name)
            optimizer.build(model.trainable_variables)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

        @tf.function
        def step(features, labels):
            with tf.GradientTape() as tape:
                loss = loss_fn(labels, model(features, training=True))
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                          model.trainable_variables))

        graph = step.get_concrete_function(x[:16], y[:16]).graph
        weights = {id(w) for w in model.weights}
        slot_shards = {
            id(shard.handle): shard.device
            for slot in optimizer.variables if id(slot) not in weights and hasattr(slot.value, "variables")
            for shard in slot.value.variables
        }
        assert len(slot_shards) >= 2 * len(model.trainable_variables)
        placeholders = {internal.name: slot_shards[id(external)]
                        for external, internal in graph.captures if id(external) in slot_shards}
        assert len(placeholders) == len(slot_shards)  # every slot shard is used by the step
        touching = [(op, placeholders[t.name]) for op in graph.get_operations()
                    for t in op.inputs if t.name in placeholders]
        assert touching

        def on(op, device):
            return tf.DeviceSpec.from_string(op.device) == tf.DeviceSpec.from_string(device)

        # An op on a resource runs where the resource is (TF's placer); what
        # matters is where its value goes or comes from: that shard's ps.
        for op, device in touching:
            if op.type in ("ReadVariableOp", "ResourceGather"):  # a read (Adagrad's sparse update gathers rows)
                neighbours = [consumer for consumer in op.outputs[0].consumers()]
            elif op.type.startswith("ResourceApply"):  # computes what it writes (psclient._keras.fused_updates)
                neighbours = [op]
            else:  # a write (Assign*, ResourceScatter*): the value written is computed there
                neighbours = [t.op for t in op.inputs[-1:] if t.op.type != "Const"]
            assert neighbours and all(on(other, device) for other in neighbours), (
                op.name, device, [(other.name, other.device) for other in neighbours])


def test_adafactor_on_the_default_partitioner_matches_local_keras(cluster, monkeypatch):
    """The reference model under "auto": the 256x256 kernel in two shards, its
    Adafactor row and column factors whole (too small to split), v split
    like the kernel; sums of both shards make the whole-variable means."""

    def model_and_data():
        keras.utils.set_random_seed(5)
        model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(256, activation="relu"),
                                  keras.layers.Dense(10)])
        rng = np.random.default_rng(5)
        return model, rng.normal(size=(48, 256)).astype("float32"), rng.integers(0, 10, (48,))

    def optimizer():
        return keras.optimizers.Adafactor(learning_rate=0.01)

    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model, x, y = model_and_data()
    local_optimizer = optimizer()
    for start in range(0, 48, 16):
        with tf.GradientTape() as tape:
            loss = loss_fn(y[start:start + 16], model(x[start:start + 16], training=True))
        local_optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                            model.trainable_variables))
    want = [w.numpy() for w in model.weights]

    with connected(cluster) as strategy:
        with strategy.scope():
            model, x, y = model_and_data()
            ps_optimizer = optimizer()
            ps_optimizer.build(model.trainable_variables)
        kernel = model.layers[0].kernel
        assert len(shard_tasks(kernel)) == 2
        index = ps_optimizer._get_variable_index(kernel)
        assert len(shard_tasks(ps_optimizer._v[index])) == 2
        assert len(shard_tasks(ps_optimizer._r[index])) == len(shard_tasks(ps_optimizer._c[index])) == 1

        from psclient._keras import adafactor

        split = []  # the variables updated shard by shard (each trace)
        real = adafactor._update_shards
        monkeypatch.setattr(adafactor, "_update_shards",
                            lambda opt, grad, var, *rest: split.append(var.name) or real(opt, grad, var, *rest))

        @tf.function
        def step(features, labels):
            with tf.GradientTape() as tape:
                loss = loss_fn(labels, model(features, training=True))
            ps_optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                             model.trainable_variables))

        for start in range(0, 48, 16):
            strategy.schedule(step, args=(x[start:start + 16], y[start:start + 16]))
            strategy.join()
        assert split and set(split) == {kernel.value.name}, split  # only the partitioned kernel
        assert_close([w.numpy() for w in model.weights], want)


@pytest.mark.parametrize("name", ["sgd", "adagrad"])
def test_sparse_update_of_each_shard_touches_rows_only_and_equals_local_keras(cluster, name):
    """No op of a shard's (or the table's) size in the step; weights and slots equal a local run.

    Ids drawn from 12 rows, so every batch repeats ids (duplicates in the
    gradient's IndexedSlices) and hits both shards. Exact equality: the
    sparse Adagrad update (psclient._keras.install) is Keras's arithmetic on
    the touched rows.
    """
    rows = 4099  # shards of 2050 and 2049 rows: sizes no other tensor has
    rng = np.random.default_rng(3)
    hot = rng.choice(rows, 12, replace=False)
    x, y = hot[rng.integers(0, 12, (64, 4))].astype("int32"), rng.integers(0, 3, (64,)).astype("int64")
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def make_step(model, optimizer):
        @tf.function
        def step(features, labels):
            with tf.GradientTape() as tape:
                loss = loss_fn(labels, model(features, training=True))
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                          model.trainable_variables))

        return step

    with connected(cluster, variable_partitioner=partitioners.FixedShardsPartitioner(2)) as strategy:
        with strategy.scope():
            model = build_model(rows=rows)
            optimizer = make_optimizer(name)
            optimizer.build(model.trainable_variables)
        assert shard_tasks(model.layers[1].embeddings) == [0, 1]
        step = make_step(model, optimizer)
        graph = step.get_concrete_function(x[:16], y[:16]).graph
        sized = [f"{op.type} {out.shape}" for op in graph.get_operations() for out in op.outputs
                 if out.dtype != tf.resource and out.shape.rank and out.shape[0] in (rows, 2050, 2049)]
        for start in range(0, 64, 16):
            strategy.schedule(step, args=(x[start:start + 16], y[start:start + 16])).result(timeout=120)
        got = {v.path: np.asarray(v.numpy()) for v in model.weights + optimizer.variables}
    assert sized == []
    local = build_model(rows=rows)
    local_optimizer = make_optimizer(name)
    local_optimizer.build(local.trainable_variables)
    local_step = make_step(local, local_optimizer)
    for start in range(0, 64, 16):
        local_step(x[start:start + 16], y[start:start + 16])
    want = [np.asarray(v.numpy()) for v in local.weights + local_optimizer.variables]
    assert len(got) == len(want)
    for (path, a), b in zip(got.items(), want):
        np.testing.assert_array_equal(a, b, err_msg=path)


def test_embedding_lookup_gathers_each_shard_on_its_ps(cluster):
    with connected(cluster, variable_partitioner=partitioners.FixedShardsPartitioner(2)) as strategy:
        with strategy.scope():
            layer = keras.layers.Embedding(65, 8)
            layer.build((None, 4))
        table = layer.embeddings.value
        assert [ps_of(shard.device) for shard in table.variables] == [0, 1]
        lookup = tf.function(lambda ids: layer(ids)).get_concrete_function(tf.TensorSpec([None, 4], tf.int32))
        ops = [op.type for op in lookup.graph.get_operations()]
        # One gather per shard (only the looked-up rows travel); the table is never read whole.
        assert ops.count("ResourceGather") == 2 and "ReadVariableOp" not in ops, ops
        ids = np.array([[0, 32, 33, 64], [-1, 1, 40, 2]], "int32")  # both shards, and Keras's -1
        np.testing.assert_array_equal(lookup(ids).numpy(), np.take(layer.embeddings.numpy(), ids, axis=0))


def issue_model_placement(strategy):
    with strategy.scope():
        model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(256), keras.layers.Dense(10)])
        optimizer = keras.optimizers.Adam(1e-3)
        optimizer.build(model.trainable_variables)
    return model, optimizer, strategy.placement()


@pytest.mark.parametrize("setting", ["default", "auto", "explicit"])
def test_default_partitioner_balances_the_issue_model(cluster, setting):
    """Dense(256) on 256 inputs + Dense(10), Adam slots, 2 ps: within 1.25x by bytes.

    The default, "auto", is MinSizePartitioner(min_shard_bytes=128 KiB,
    max_shards=num_ps), the same as passing it explicitly.
    """
    kwargs = {} if setting == "default" else {"variable_partitioner": "auto" if setting == "auto" else
                                              partitioners.MinSizePartitioner(min_shard_bytes=128 << 10,
                                                                              max_shards=2)}
    with connected(cluster, **kwargs) as strategy:
        if setting != "explicit":
            assert isinstance(strategy.variable_partitioner, partitioners.MinSizePartitioner)
            assert strategy.variable_partitioner(tf.TensorShape([32, 1024]), tf.float32) == [1, 1]  # 128 KiB
            assert strategy.variable_partitioner(tf.TensorShape([33, 1024]), tf.float32) == [2, 1]
        model, optimizer, report = issue_model_placement(strategy)
        loads = report["bytes_per_ps"]
        assert max(loads) / min(loads) <= 1.25, loads
        kernel = model.layers[0].kernel
        assert shard_tasks(kernel) == [0, 1] or shard_tasks(kernel) == [1, 0]
        shards = [entry for entry in report["variables"] if entry["part"] is not None]
        assert {entry["ps_index"] for entry in shards} == {0, 1}
        assert all(entry["rows"] in ((0, 128), (128, 256)) and entry["nbytes"] == 128 * 256 * 4
                   for entry in shards), shards
        # Small variables stay whole.
        assert len(shard_tasks(model.layers[1].kernel)) == 1
        assert len(shard_tasks(model.layers[0].bias)) == 1
        for variable, m, v in zip(model.trainable_variables, optimizer._momentums, optimizer._velocities):
            assert shard_tasks(m) == shard_tasks(v) == shard_tasks(variable), variable.path


def test_no_partitioner_keeps_every_variable_whole(cluster):
    with connected(cluster, variable_partitioner=None) as strategy:
        assert strategy.variable_partitioner is None
        model, _optimizer, report = issue_model_placement(strategy)
        assert all(entry["part"] is None for entry in report["variables"]), report["variables"]
        assert len(shard_tasks(model.layers[0].kernel)) == 1
        # Whole variables cannot balance this model: the kernel and its two slots on one ps.
        assert max(report["bytes_per_ps"]) == 3 * 256 * 256 * 4, report["bytes_per_ps"]


@pytest.mark.long
def test_checkpoint_round_trip_saves_full_values(cluster, tmp_path):
    with connected(cluster, checkpoint_dir=tmp_path,
                   variable_partitioner=partitioners.FixedShardsPartitioner(2)) as strategy:
        with strategy.scope():
            model = build_model()
            compile_model(model, "adam")
        x, y = data()
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), epochs=1, steps_per_epoch=2, verbose=0)
        path = strategy.save_checkpoint()
        saved = [w.numpy() for w in model.weights]
        # Full, unpartitioned shapes under each variable's key.
        shapes = sorted(tuple(shape) for name, shape in tf.train.list_variables(path)
                        if name.endswith(".ATTRIBUTES/VARIABLE_VALUE") and name.startswith("v"))
        assert (65, 8) in shapes and (32, 32) in shapes, shapes
        for weight in model.weights:
            weight.assign(np.zeros(weight.shape, "float32"))
        assert strategy.restore()["path"] == path
        assert_close([w.numpy() for w in model.weights], saved)


def test_tf_checkpoint_of_the_model_holds_full_values(cluster, tmp_path):
    """What the sidecar evaluator and Keras callbacks read and write: tf.train.Checkpoint(model=...)."""
    x, y = data()
    with connected(cluster, variable_partitioner=partitioners.FixedShardsPartitioner(2)) as strategy:
        with strategy.scope():
            model = build_model()
            compile_model(model, "adam")
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), epochs=1, steps_per_epoch=2, verbose=0)
        path = tf.train.Checkpoint(model=model).write(str(tmp_path / "model"))
        trained = [w.numpy() for w in model.weights]
        # Read back into the partitioned model (each shard gets its rows).
        for weight in model.weights:
            weight.assign(np.zeros(weight.shape, "float32"))
        tf.train.Checkpoint(model=model).read(path).expect_partial()
        assert_close([w.numpy() for w in model.weights], trained)
    local = build_model(seed=5)  # a model in this process, no strategy: as the sidecar builds it
    tf.train.Checkpoint(model=local).read(path).expect_partial()
    assert_close([w.numpy() for w in local.weights], trained)


def test_evaluate_and_predict_match_local_keras(cluster):
    x, y = data()
    with connected(cluster, variable_partitioner=partitioners.FixedShardsPartitioner(2)) as strategy:
        with strategy.scope():
            model = build_model()
            compile_model(model, "sgd")
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
        loss = model.evaluate(dataset, steps=4, verbose=0)
        predictions = model.predict(tf.data.Dataset.from_tensor_slices(x).batch(16), steps=4, verbose=0)
    local = build_model()
    compile_model(local, "sgd")
    np.testing.assert_allclose(predictions, local.predict(x, batch_size=16, verbose=0), atol=ATOL, rtol=0)
    np.testing.assert_allclose(loss, local.evaluate(x, y, batch_size=16, verbose=0), atol=ATOL, rtol=1e-6)


def test_model_save_writes_full_weights_load_model_reads_without_cluster(cluster, tmp_path):
    with connected(cluster, variable_partitioner=partitioners.FixedShardsPartitioner(2)) as strategy:
        with strategy.scope():
            model = build_model()
            compile_model(model, "sgd")
        x, y = data()
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), epochs=1, steps_per_epoch=2, verbose=0)
        model.save(tmp_path / "m.keras")
        weights = [w.numpy() for w in model.weights]
    loaded = keras.models.load_model(tmp_path / "m.keras")  # no strategy: plain local variables
    assert all(isinstance(w.value, tf.Variable) for w in loaded.weights)
    assert [tuple(w.shape) for w in loaded.weights] == [w.shape for w in weights]
    assert_close([w.numpy() for w in loaded.weights], weights)


def test_bad_partitioners_name_the_variable(cluster):
    with pytest.raises(TypeError, match="variable_partitioner=3 of type int"):
        psclient.ParameterServerStrategy(cluster, variable_partitioner=3)
    with pytest.raises(ValueError, match="variable_partitioner='min'. Expected \"auto\" \\(the default\\), None"):
        psclient.ParameterServerStrategy(cluster, variable_partitioner="min")
    offered = []

    def partitioner(shape, dtype):
        offered.append(shape.as_list())
        # [6, 4]: splits axis 1 too (refused); [6]: more shards than rows (refused).
        return [2, 2] if shape.rank == 2 else [7]

    with connected(cluster, variable_partitioner=partitioner) as strategy:
        with strategy.scope():
            scalar = tf.Variable(1.0, name="scalar")
            one_row = tf.Variable(tf.zeros([1, 8]), name="one_row")
            with pytest.raises(PartitionError, match=r"'table' of shape \[6, 4\].*Received: \[2, 2\]"):
                tf.Variable(tf.zeros([6, 4]), name="table")
            with pytest.raises(PartitionError, match=r"'wide' of shape \[6\]: 7 shards for 6 rows"):
                tf.Variable(tf.zeros([6]), name="wide")
        # Scalars and single-row variables are never offered: they stay whole.
        assert offered == [[6, 4], [6]]
        assert len(shard_tasks(scalar)) == 1 and len(shard_tasks(one_row)) == 1
        # Nothing half-created: the refused variables are not in the placement.
        names = [entry["name"] for entry in strategy.placement()["variables"]]
        assert not any("table" in name or "wide" in name for name in names), names


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adafactor"])
def test_fit_matches_local_keras(one_worker_cluster, optimizer):
    x, y = data()
    with connected(one_worker_cluster,
                   variable_partitioner=partitioners.FixedShardsPartitioner(2)) as strategy:
        with strategy.scope():
            model = build_model()
            compile_model(model, optimizer)
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
        model.fit(dataset, epochs=2, steps_per_epoch=4, verbose=0)
        # Every weight (embedding table, kernels, biases) is cut in two, one shard per ps.
        assert all(sorted(shard_tasks(w)) == [0, 1] for w in model.weights), [shard_tasks(w) for w in model.weights]
        got = [w.numpy() for w in model.weights]
    assert_close(got, local_weights(optimizer))


@pytest.mark.long
def test_checkpoint_restores_into_another_partitioning(cluster, tmp_path):
    """Values are saved whole: a checkpoint of 2 shards restores into whole variables and back."""
    x, y = data()
    with connected(cluster, checkpoint_dir=tmp_path,
                   variable_partitioner=partitioners.FixedShardsPartitioner(2)) as strategy:
        with strategy.scope():
            model = build_model()
            compile_model(model, "adam")
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), epochs=1, steps_per_epoch=2, verbose=0)
        strategy.save_checkpoint()
        saved = [w.numpy() for w in model.weights] + [v.numpy() for v in model.optimizer.variables]
    for partitioner in (None, partitioners.FixedShardsPartitioner(3)):
        with connected(cluster, checkpoint_dir=tmp_path, variable_partitioner=partitioner) as strategy:
            with strategy.scope():
                model = build_model(seed=7)  # other initial values
                compile_model(model, "adam")
                model.optimizer.build(model.trainable_variables)
            assert strategy.restore() is not None
            assert {len(shard_tasks(w)) for w in model.weights} == ({1} if partitioner is None else {3})
            assert_close([w.numpy() for w in model.weights] + [v.numpy() for v in model.optimizer.variables],
                         saved)


@pytest.mark.long
def test_lost_ps_gets_its_shards_back_from_the_checkpoint(local, cluster, tmp_path):
    x, y = data()
    with connected(cluster, checkpoint_dir=tmp_path, checkpoint_every=20,
                   variable_partitioner=partitioners.FixedShardsPartitioner(2)) as strategy:
        with strategy.scope():
            model = build_model()
            optimizer = make_optimizer("adam")
            optimizer.build(model.trainable_variables)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                          model.trainable_variables))
            return loss

        futures = [strategy.schedule(step) for _ in range(120)]
        psclient.wait(futures[:60], timeout=180)
        try:
            local.kill("ps", 1)
        finally:
            local.restart("ps", 1)
        strategy.join(timeout=200)
        assert all(f.exception() is None for f in futures)
        ps = strategy.stats()["ps"][1]
        assert ps["failures"] == 1 and ps["recoveries"] == 1
        # Both shards of every weight answer again, and training goes on from the restored values.
        assert all(np.isfinite(w.numpy()).all() for w in model.weights)
        assert float(strategy.schedule(step).result(60)) < float(futures[0].result())


# --------------------------------------- the sidecar evaluator, BackupAndRestore
def compile_with_accuracy(model, optimizer="adam"):
    model.compile(optimizer=make_optimizer(optimizer),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])


def local_evaluation(weights):
    """What a model in this process with `weights` scores on data(): what the sidecar must report."""
    model = build_model(seed=9)
    compile_with_accuracy(model)
    model.set_weights(weights)
    x, y = data()
    return model.evaluate(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), verbose=0, return_dict=True)


def test_sidecar_evaluates_a_partitioned_models_checkpoints(cluster, tmp_path):
    """TF checkpoints (CheckpointManager) and Keras ModelCheckpoint files written by a partitioned model."""
    from psclient import SidecarEvaluator, write_final_marker

    x, y = data()
    tf_dir, keras_dir = tmp_path / "tf", tmp_path / "keras"
    with connected(cluster, variable_partitioner=partitioners.FixedShardsPartitioner(2)) as strategy:
        with strategy.scope():
            model = build_model()
            compile_with_accuracy(model)
        assert all(len(shard_tasks(w)) == 2 for w in model.weights)
        manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=model), str(tf_dir), max_to_keep=None)
        weights = []
        for _epoch in range(2):
            model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), epochs=1, verbose=0,
                      callbacks=[keras.callbacks.ModelCheckpoint(str(keras_dir / "last.weights.h5"),
                                                                 save_weights_only=True)])
            last = manager.save()
            weights.append([w.numpy() for w in model.weights])
        write_final_marker(tf_dir, last, step=int(model.optimizer.iterations.numpy()))
        write_final_marker(keras_dir, str(keras_dir / "last.weights.h5"))

    def evaluate(directory):
        evaluator_model = build_model(seed=5)  # other initial values: the checkpoint must replace them
        compile_with_accuracy(evaluator_model)
        return SidecarEvaluator(evaluator_model, tf.data.Dataset.from_tensor_slices((x, y)).batch(16),
                                directory, poll_interval=0.05, idle_timeout=60, settle_time=0).start()

    want = local_evaluation(weights[-1])
    for directory in (tf_dir, keras_dir):
        report = evaluate(directory)
        assert report.stop_reason.startswith("the final checkpoint"), report
        assert report.unreadable == [], report.unreadable
        assert len(report.evaluations) == 1, report.evaluations
        assert report.evaluations[0]["metrics"] == pytest.approx(want, rel=1e-5, abs=1e-6), directory
    assert report.evaluations[0]["step"] == 8  # the optimizer's iterations, from the Keras file


@pytest.mark.long
@pytest.mark.parametrize("first, then", [(2, 2), (2, 1), (1, 2)])
def test_backup_and_restore_resumes_a_partitioned_fit(one_worker_cluster, tmp_path, first, then):
    """An interrupted fit resumes from psclient.BackupAndRestore's backup: the weights equal an
    uninterrupted local Keras run (one worker: the local order of steps). The backup holds full
    values, so it restores into another partitioning: shards into whole variables, and a backup
    of whole variables (e.g. written with variable_partitioner=None) into shards."""
    x, y = data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2:
                raise RuntimeError("interrupted")

    class RecordStart(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.weights = [w.numpy() for w in self.model.weights]

    def partitioner(shards):
        return partitioners.FixedShardsPartitioner(2) if shards == 2 else None

    backup = str(tmp_path / "backup")
    with connected(one_worker_cluster, variable_partitioner=partitioner(first)) as strategy:
        with strategy.scope():
            model = build_model()
            compile_model(model, "adam")
        with pytest.raises(RuntimeError, match="interrupted"):
            model.fit(dataset, epochs=4, verbose=0, callbacks=[psclient.BackupAndRestore(backup), Interrupt()])
        saved = [w.numpy() for w in model.weights]
    with connected(one_worker_cluster, variable_partitioner=partitioner(then)) as strategy:
        with strategy.scope():
            model = build_model(seed=7)  # other initial values: the backup must replace them
            compile_model(model, "adam")
        assert {len(shard_tasks(w)) for w in model.weights} == {then}
        start = RecordStart()
        history = model.fit(dataset, epochs=4, verbose=0, callbacks=[psclient.BackupAndRestore(backup), start])
        assert history.epoch == [2, 3]
        assert int(model.optimizer.iterations.numpy()) == 16
        assert_close(start.weights, saved)
        got = [w.numpy() for w in model.weights]
    assert_close(got, local_weights("adam", epochs=4))
