"""The data path: optimizer updates run on the ps of their variable, lookups move rows.

psclient/_coordinator/training/updates.py places every Keras optimizer update on the ps
task of its variable; psclient/_keras/install.py gathers embedding rows on the
ps and places the EMA's averages. docs/data_path.md states what travels.

The graphs are checked statically: every op of a traced step is given the
task TF's placer puts it on (its explicit device, else the task of a variable
it reads or writes, else the calling worker), and a tensor "crosses" when its
producer and a consumer are on different tasks. The byte counts are those
tensors' sizes.

One cluster for the module: 1 worker, so that a fixed sequence of batches is a
deterministic run that a local Keras run must reproduce, and 2 ps tasks, so
that variables and their updates sit on different tasks.
"""

from __future__ import annotations

import collections
import warnings

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

from psclient._coordinator.runtime import ps_index_of  # noqa: E402
from psclient._coordinator.strategy import ParameterServerStrategy  # noqa: E402

pytestmark = pytest.mark.timeout(600)

#: Ops that write a variable, and the input that carries the value written.
WRITES = {
    "AssignVariableOp": 1, "AssignAddVariableOp": 1, "AssignSubVariableOp": 1,
    "ResourceScatterAdd": 2, "ResourceScatterSub": 2, "ResourceScatterUpdate": 2,
    # One kernel computes and writes the weight and its slots (psclient._keras.fused_updates).
    "ResourceApplyAdam": None, "ResourceApplyKerasMomentum": None, "ResourceApplyGradientDescent": None,
}
#: Ops whose output is a variable's value (or some of its rows).
READS = {"ReadVariableOp", "ResourceGather"}
STEPS = 6
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.fixture(scope="module")
def strategy(one_worker_two_ps):
    # Whole variables, said explicitly: this module reads the data path of
    # unpartitioned ones (partitioned ones: tests/strategy/test_partitioned.py).
    s = ParameterServerStrategy(one_worker_two_ps.cluster, variable_partitioner=None)
    yield s
    s.shutdown()


# ------------------------------------------------------------ models and data
def dense_model(sizes=(12, 16, 4)):
    layers = [keras.Input((sizes[0],))]
    layers += [keras.layers.Dense(n, activation="relu") for n in sizes[1:-1]]
    return keras.Sequential([*layers, keras.layers.Dense(sizes[-1])])


def embedding_model(rows=200, width=16, ids=8):
    return keras.Sequential([
        keras.Input((ids,), dtype="int32"),
        keras.layers.Embedding(rows, width),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(4),
    ])


def batches(kind, n=STEPS, batch=16, rows=200, seed=0):
    rng = np.random.default_rng(seed)
    if kind == "dense":
        xs = [rng.standard_normal((batch, 12)).astype("float32") for _ in range(n)]
    else:
        # Ids cover a fraction of the table, so a dense update and a sparse one differ.
        xs = [rng.integers(0, rows // 4, (batch, 8)).astype("int32") for _ in range(n)]
    ys = [rng.integers(0, 4, batch).astype("int32") for _ in range(n)]
    return [(tf.constant(x), tf.constant(y)) for x, y in zip(xs, ys)]


def make_step(model, optimizer):
    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return train_step


#: Adam's one-kernel update on the ps (psclient._keras.fused_updates) forms 1 - beta in float32, where
#: Keras forms it in Python floats: with betas that float32 holds exactly, both round alike.
#: The defaults' difference is test_fused_adam_with_default_betas_is_adam_with_float32_betas's.
FLOAT32_BETAS = {"beta_1": float(np.float32(0.9)), "beta_2": float(np.float32(0.999))}
OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "sgd_nesterov": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "adam": lambda: keras.optimizers.Adam(1e-2, **FLOAT32_BETAS),
    "adamw": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.05, **FLOAT32_BETAS),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "rmsprop": lambda: keras.optimizers.RMSprop(1e-2, momentum=0.9, centered=True),
    "adafactor": lambda: keras.optimizers.Adafactor(0.05),
    "lion": lambda: keras.optimizers.Lion(1e-3),
    "ftrl": lambda: keras.optimizers.Ftrl(0.1, l1_regularization_strength=1e-3, l2_regularization_strength=1e-3),
    "nadam": lambda: keras.optimizers.Nadam(1e-2),
    "adam_ema": lambda: keras.optimizers.Adam(1e-2, use_ema=True, ema_overwrite_frequency=4, **FLOAT32_BETAS),
    "sgd": lambda: keras.optimizers.SGD(0.5),
}
#: The one kernel each applies to a weight with a dense gradient (psclient._keras.fused_updates).
FUSED = {"adam": "ResourceApplyAdam", "adamw": "ResourceApplyAdam", "adam_ema": "ResourceApplyAdam",
         "sgd": "ResourceApplyGradientDescent", "sgd_momentum": "ResourceApplyKerasMomentum",
         "sgd_nesterov": "ResourceApplyKerasMomentum"}


# ------------------------------------------------------------- graph reading
def _task(device: str | None) -> str:
    index = ps_index_of(device)
    return "worker" if index is None else f"ps{index}"


def _tf_variable(variable):
    return variable.value if isinstance(variable, keras.Variable) else variable


class StepGraph:
    """A traced step's ops, each on the task TF's placer gives it."""

    def __init__(self, concrete, variables):
        graph = concrete.graph
        self.ops = graph.get_operations()
        by_handle = {id(_tf_variable(v).handle): v for v in variables}
        self.resources = {}  # resource placeholder name -> (task, variable or None)
        for external, internal in graph.captures:
            if internal.dtype == tf.resource:
                self.resources[internal.name] = (_task(getattr(external, "device", None)), by_handle.get(id(external)))
        calls = [op.type for op in self.ops if op.type in ("While", "PartitionedCall", "StatefulPartitionedCall")]
        assert not calls, f"the analysis reads one flat graph; this one calls functions: {calls}"

    def task(self, op) -> str:
        if op.device:
            return _task(op.device)
        for tensor in op.inputs:
            if tensor.dtype == tf.resource and tensor.name in self.resources:
                return self.resources[tensor.name][0]  # colocated with its variable
        return "worker"

    def variable(self, op):
        found = self.variables(op)
        return found[0] if found else None

    def variables(self, op) -> list:
        return [self.resources[tensor.name][1] for tensor in op.inputs
                if tensor.dtype == tf.resource and tensor.name in self.resources
                and self.resources[tensor.name][1] is not None]

    def variables_of(self, variables) -> list:
        """Those of `variables` this graph captured."""
        captured = {id(v) for _, v in self.resources.values() if v is not None}
        return [v for v in variables if id(v) in captured]

    def writes(self, variables):
        """(op, variable) for each op writing one of `variables` (a fused update: each it writes)."""
        wanted = {id(v) for v in variables}
        return [(op, v) for op in self.ops if op.type in WRITES
                for v in (self.variables(op) if WRITES[op.type] is None else [self.variable(op)])
                if v is not None and id(v) in wanted]

    def crossing(self) -> dict[tuple[str, str], int]:
        """Bytes per (from task, to task) of the tensors that cross, each counted once per receiver."""
        moved: dict[tuple[str, str], int] = collections.Counter()
        seen = set()
        for op in self.ops:
            to = self.task(op)
            for tensor in op.inputs:
                source = self.task(tensor.op)
                if tensor.dtype == tf.resource or source == to or (tensor.name, to) in seen:
                    continue
                seen.add((tensor.name, to))
                assert tensor.shape.is_fully_defined(), f"unknown size of {tensor.name} {tensor.shape}"
                moved[(source, to)] += int(np.prod(tensor.shape.as_list(), dtype=np.int64)) * tensor.dtype.size
        return dict(moved)


def worker_ps_bytes(moved) -> tuple[int, int]:
    """(worker -> ps, ps -> worker) bytes."""
    up = sum(n for (a, b), n in moved.items() if a == "worker" and b != "worker")
    down = sum(n for (a, b), n in moved.items() if a != "worker" and b == "worker")
    return up, down


def nbytes(variables) -> int:
    return sum(int(np.prod(v.shape)) * 4 for v in variables)


def slots_of(optimizer, weight) -> list:
    """The slots a fused update of `weight` writes with it."""
    index = optimizer._get_variable_index(weight)
    if isinstance(optimizer, keras.optimizers.Adam):
        return [optimizer._momentums[index], optimizer._velocities[index]]
    return [optimizer.momentums[index]] if optimizer.momentum else []


def assert_updates_on_ps(graph: StepGraph, model, optimizer):
    """Each weight and slot is written on its ps, with a value computed there; no slot is read elsewhere."""
    # Per-weight state; the scalars (step counter, learning rate, Nadam's product) are not.
    slots = [v for v in optimizer.variables if len(v.shape)]
    updated = list(model.trainable_variables) + slots
    writes = graph.writes(updated)
    written = {id(v) for _, v in writes}
    assert written >= {id(v) for v in model.trainable_variables}, "a weight is never written"
    for op, variable in writes:
        home = _task(_tf_variable(variable).device)
        assert home.startswith("ps")
        value = op if WRITES[op.type] is None else op.inputs[WRITES[op.type]].op  # fused: computed in the op
        assert (graph.task(op), graph.task(value)) == (home, home), (
            f"{variable.path}: {op.type} on {graph.task(op)}, its value {value.type} "
            f"computed on {graph.task(value)}; expected both on {home}"
        )
    for op in graph.ops:
        variable = graph.variable(op)
        if op.type in READS and variable is not None and any(variable is s for s in slots):
            home = _task(_tf_variable(variable).device)
            readers = {graph.task(c) for out in op.outputs for c in out.consumers()}
            assert readers <= {home}, f"slot {variable.path} read on {readers - {home}}"


# ----------------------------------------------------- (a) + (b) custom loops
CASES = [(name, "dense") for name in OPTIMIZERS if name != "sgd"] + [
    ("sgd", "embedding"), ("adagrad", "embedding"), ("adam", "embedding"),
]


@pytest.mark.parametrize("name,kind", CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_updates_run_on_the_ps_and_equal_local_keras(strategy, name, kind):
    build = dense_model if kind == "dense" else embedding_model
    data = batches(kind)

    keras.utils.set_random_seed(1)
    local = build()
    initial = [w.copy() for w in local.get_weights()]
    local_step = make_step(local, local_optimizer := OPTIMIZERS[name]())
    for x, y in data:
        local_step(x, y)
    expected = local.get_weights()
    del local_optimizer

    with strategy.scope():
        model = build()
        model.set_weights(initial)
        optimizer = OPTIMIZERS[name]()
        optimizer.build(model.trainable_variables)
        step = make_step(model, optimizer)
        concrete = step.get_concrete_function(*data[0])
    # Placement balances bytes over everything created so far: weights may sit on one ps or both.
    assert all(_task(_tf_variable(v).device) != "worker" for v in model.variables + optimizer.variables)
    graph = StepGraph(concrete, list(model.trainable_variables) + list(optimizer.variables))
    assert_updates_on_ps(graph, model, optimizer)
    fused = [op for op in graph.ops if WRITES.get(op.type, 0) is None]
    if name in FUSED:
        # One kernel per weight with a dense gradient, writing it and its slots
        # (psclient._keras.fused_updates); an embedding table's IndexedSlices keep Keras's ops.
        dense = [w for w in model.trainable_variables if kind == "dense" or w is not model.layers[0].embeddings]
        slots = [slot for w in dense for slot in slots_of(optimizer, w)]
        assert {op.type for op in fused} == {FUSED[name]} and len(fused) == len(dense)
        assert {id(v) for op in fused for v in graph.variables(op)} == {
            id(v) for v in graph.variables_of(dense + slots)}
    else:
        assert not fused
    if kind == "embedding":
        table = model.layers[0].embeddings
        table_writes = {op.type for op, _ in graph.writes([table])}
        # SGD and Adagrad apply the gradient's rows with scatter ops; Adam keeps
        # Keras's dense semantics (every row's moments decay), on the ps.
        assert table_writes == ({"AssignSubVariableOp"} if name == "adam" else {"ResourceScatterSub"})

    for x, y in data:
        strategy.schedule(step, args=(x, y)).result(timeout=120)
    got = model.get_weights()
    # Keras's own ops, run on the ps instead of the worker, or SGD's one kernel: bit-identical
    # here (the same arithmetic on the same CPU); Adam's one kernel with float32 betas: within
    # the tolerance, which also allows another kernel choice where ps and worker machines differ.
    for g, e, i in zip(got, expected, initial):
        np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-7)
        if name.startswith("sgd"):
            np.testing.assert_array_equal(g, e)
    assert max(float(np.max(np.abs(e - i))) for e, i in zip(expected, initial)) > 1e-4  # it trained
    assert int(optimizer.iterations.numpy()) == STEPS


def test_ema_averages_are_updated_on_their_ps(strategy):
    with strategy.scope():
        model = dense_model()
        optimizer = OPTIMIZERS["adam_ema"]()
        optimizer.build(model.trainable_variables)
        step = make_step(model, optimizer)
        concrete = step.get_concrete_function(*batches("dense", n=1)[0])
    averages = optimizer._model_variables_moving_average
    graph = StepGraph(concrete, list(averages))
    writes = graph.writes(averages)
    assert {id(v) for _, v in writes} == {id(v) for v in averages}
    for op, average in writes:
        home = _task(_tf_variable(average).device)
        assert graph.task(op.inputs[1].op) == home, f"{average.path}'s new value computed off its ps"


# ------------------------------------------------------------- (a) model.fit
def test_fit_train_function_updates_on_the_ps_and_equals_local_fit(strategy):
    from psclient._keras.trainer import TrainFunction

    rng = np.random.default_rng(3)
    x = rng.standard_normal((96, 12)).astype("float32")
    y = rng.integers(0, 4, 96).astype("int32")

    def dataset():
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(16, drop_remainder=True)

    def compiled(model):
        model.compile(optimizer=keras.optimizers.Adam(1e-2, **FLOAT32_BETAS), loss=LOSS)
        return model

    keras.utils.set_random_seed(2)
    local = compiled(dense_model())
    initial = [w.copy() for w in local.get_weights()]
    with warnings.catch_warnings():  # psclient says a model outside the scope trains locally: on purpose here
        warnings.filterwarnings("ignore", r"model\.fit\(\) trains .* in this process", UserWarning)
        local.fit(dataset(), epochs=1, shuffle=False, verbose=0)

    with strategy.scope():
        model = compiled(dense_model())
        model.set_weights(initial)
        model.optimizer.build(model.trainable_variables)
        # fit's own train function (psclient/_keras/trainer.py), one step per call.
        train_function = TrainFunction(model, strategy, steps_per_epoch=1)
        concrete = train_function._one_step.get_concrete_function(iter(dataset()))
    graph = StepGraph(concrete, list(model.trainable_variables) + list(model.optimizer.variables))
    assert_updates_on_ps(graph, model, model.optimizer)

    model.fit(dataset(), epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 6
    for got, expected in zip(model.get_weights(), local.get_weights()):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)



@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_fit_with_a_loss_scale_optimizer_equals_local_fit(strategy, policy):
    """Mixed precision as Keras's guide writes it (`mixed_float16`: compile wraps the optimizer in a
    LossScaleOptimizer), and a LossScaleOptimizer given explicitly: fit runs as locally, a batch with
    non-finite gradients included (its step skipped, the scale halved). LossScaleOptimizer refuses
    the cross-replica context its apply() found before (ValueError "apply() must be called in a
    replica context", raised while tracing)."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((96, 12)).astype("float32")
    x[40, 3] = np.inf  # the third batch's gradients are not finite
    y = rng.integers(0, 4, 96).astype("int32")

    def dataset():
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(16, drop_remainder=True)

    def compiled(model):
        optimizer = keras.optimizers.Adam(1e-2, **FLOAT32_BETAS)
        if policy == "float32":
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer, initial_scale=2.0**10, dynamic_growth_steps=2)
        model.compile(optimizer=optimizer, loss=LOSS)
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        return model

    def state(model):
        optimizer = model.optimizer
        return (model.get_weights(), float(optimizer.dynamic_scale.numpy()), int(optimizer.step_counter.numpy()),
                int(optimizer.iterations.numpy()))

    keras.mixed_precision.set_dtype_policy(policy)
    try:
        keras.utils.set_random_seed(5)
        local = compiled(dense_model())
        initial = [w.copy() for w in local.get_weights()]
        with warnings.catch_warnings():  # a model outside the scope trains locally: on purpose here
            warnings.filterwarnings("ignore", r"model\.fit\(\) trains .* in this process", UserWarning)
            local.fit(dataset(), epochs=1, shuffle=False, verbose=0)
        with strategy.scope():
            model = compiled(dense_model())
            model.set_weights(initial)
        model.fit(dataset(), epochs=1, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    weights, scale, counter, iterations = state(model)
    local_weights, local_scale, local_counter, local_iterations = state(local)
    # 6 batches, one skipped: Keras counts the applied steps only.
    assert (scale, counter, iterations) == (local_scale, local_counter, local_iterations)
    assert iterations == 5 and scale < (2.0**10 if policy == "float32" else 2.0**15) * 2.0**5
    assert all(ps_index_of(v.device) is not None for v in (_tf_variable(model.optimizer.dynamic_scale),
                                                           _tf_variable(model.optimizer.step_counter)))
    for got, expected in zip(weights, local_weights):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_fused_adam_with_default_betas_is_adam_with_float32_betas(strategy):
    """Adam's one-kernel update on the ps forms 1 - beta_1 and 1 - beta_2 from the betas in float32
    (TF's ResourceApplyAdam); Keras forms them in Python floats, then rounds. With the defaults (0.9,
    0.999) that is Keras's Adam with its betas rounded to float32: equal to that at rtol 1e-6, and
    within 1e-4 of Keras's with the betas as given (1 - float32(0.999) is 1.3e-5 off 0.001)."""
    data = batches("dense")
    keras.utils.set_random_seed(1)
    initial = dense_model().get_weights()

    def local_run(**betas):
        model = dense_model()
        model.set_weights(initial)
        step = make_step(model, keras.optimizers.Adam(1e-2, **betas))
        for x, y in data:
            step(x, y)
        return model.get_weights()

    as_given, rounded = local_run(), local_run(**FLOAT32_BETAS)
    with strategy.scope():
        model = dense_model()
        model.set_weights(initial)
        optimizer = keras.optimizers.Adam(1e-2)
        optimizer.build(model.trainable_variables)
        step = make_step(model, optimizer)
    assert "ResourceApplyAdam" in {op.type for op in step.get_concrete_function(*data[0]).graph.get_operations()}
    for x, y in data:
        strategy.schedule(step, args=(x, y)).result(timeout=120)
    for got, exact, loose in zip(model.get_weights(), rounded, as_given):
        np.testing.assert_allclose(got, exact, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(got, loose, rtol=1e-4, atol=1e-6)
    assert any(not np.array_equal(a, b) for a, b in zip(as_given, rounded))  # the betas' rounding shows


def test_a_subclass_of_adam_keeps_keras_ops(strategy):
    """Only Keras's own Adam and AdamW classes are fused: a subclass may change the update or its
    slots, and subclassing is how a user keeps Keras's ops (and its rounding) bit for bit."""

    class MyAdam(keras.optimizers.Adam):
        pass

    data = batches("dense")
    keras.utils.set_random_seed(1)
    local = dense_model()
    initial = [w.copy() for w in local.get_weights()]
    local_step = make_step(local, keras.optimizers.Adam(1e-2))
    for x, y in data:
        local_step(x, y)
    with strategy.scope():
        model = dense_model()
        model.set_weights(initial)
        optimizer = MyAdam(1e-2)
        optimizer.build(model.trainable_variables)
        step = make_step(model, optimizer)
    assert "ResourceApplyAdam" not in {op.type for op in step.get_concrete_function(*data[0]).graph.get_operations()}
    for x, y in data:
        strategy.schedule(step, args=(x, y)).result(timeout=120)
    for got, expected in zip(model.get_weights(), local.get_weights()):
        np.testing.assert_array_equal(got, expected)


# ------------------------------------------------------- (c) bytes per step
def test_adam_moves_twice_the_parameter_bytes_per_step(strategy):
    with strategy.scope():
        model = dense_model((784, 64, 64, 10))
        optimizer = keras.optimizers.Adam(1e-3)
        optimizer.build(model.trainable_variables)
        step = make_step(model, optimizer)
        x = tf.zeros((32, 784))
        y = tf.zeros((32,), tf.int32)
        concrete = step.get_concrete_function(x, y)
    moved = StepGraph(concrete, list(model.trainable_variables) + list(optimizer.variables)).crossing()
    up, down = worker_ps_bytes(moved)
    params = nbytes(model.trainable_variables)
    # Gradients up, weights down; the variable and both Adam slots for the
    # update (8x in all, read and written back) never travel. The few extra
    # bytes are scalars: the learning rate, the step counter.
    assert params <= up < params * 1.01, (up, params)
    assert params <= down < params * 1.01, (down, params)
    strategy.schedule(step, args=(x, y)).result(timeout=120)


# --------------------------------------------- (d) embedding rows, not tables
@pytest.mark.parametrize("name", ["adagrad", "adam"])
def test_an_embedding_step_moves_the_rows_it_touches_not_the_table(strategy, name):
    ids = tf.constant(np.random.default_rng(4).integers(0, 20_000, (32, 8)).astype("int32"))
    y = tf.zeros((32,), tf.int32)
    moved = {}
    for rows in (20_000, 200_000):
        with strategy.scope():
            model = embedding_model(rows=rows)
            optimizer = OPTIMIZERS[name]()
            optimizer.build(model.trainable_variables)
            step = make_step(model, optimizer)
            concrete = step.get_concrete_function(ids, y)
        graph = StepGraph(concrete, list(model.trainable_variables) + list(optimizer.variables))
        moved[rows] = sum(worker_ps_bytes(graph.crossing()))
        strategy.schedule(step, args=(ids, y)).result(timeout=120)
    touched = 32 * 8 * 16 * 4  # the looked-up rows, as sent and as gradients
    assert moved[200_000] == pytest.approx(moved[20_000], rel=0.10), moved
    assert moved[20_000] < 4 * touched < 20_000 * 16 * 4, moved


def test_lookup_on_the_ps_keeps_keras_negative_index_semantics(strategy):
    with strategy.scope():
        layer = keras.layers.Embedding(10, 3)
        layer.build((None,))
    table = layer.embeddings.numpy()
    ids = tf.constant([0, 9, -1, -10, 4], tf.int32)

    @tf.function
    def lookup(ids):
        return keras.ops.take(layer.embeddings, ids, axis=0), layer(ids)

    with strategy.scope():
        graph = StepGraph(lookup.get_concrete_function(ids), [layer.embeddings])
    gathers = [op for op in graph.ops if op.type in READS]
    assert {op.type for op in gathers} == {"ResourceGather"}  # never the whole table
    rows, from_layer = strategy.schedule(lookup, args=(ids,)).result(timeout=60)
    np.testing.assert_array_equal(rows, table[[0, 9, 9, 0, 4]])
    np.testing.assert_array_equal(from_layer, rows)
    # Not a ps variable, or not axis 0: Keras's own take.
    local = keras.Variable(table)
    np.testing.assert_array_equal(keras.ops.take(local, ids, axis=0), table[[0, 9, 9, 0, 4]])
    np.testing.assert_array_equal(
        strategy.schedule(tf.function(lambda: keras.ops.take(layer.embeddings, [2, -1], axis=1))).result(60),
        table[:, [2, 2]],
    )


def test_variables_off_the_ps_keep_tfs_own_update(strategy):
    from psclient._coordinator.training.updates import ps_device_of

    with strategy.scope():  # installs the placement
        on_ps = keras.Variable(np.ones(3, "float32"))
    assert ps_device_of(on_ps) == _tf_variable(on_ps).device
    local_tf, local_keras = tf.Variable(1.0), keras.Variable(1.0)
    for value in (local_tf, local_keras, [on_ps], tf.constant(1.0), None):
        assert ps_device_of(value) is None
    model, optimizer = dense_model(), keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
    concrete = make_step(model, optimizer).get_concrete_function(*batches("dense", n=1)[0])
    placed = {op.device for op in concrete.graph.get_operations() if op.type in {*WRITES, *READS, "Mul", "Sqrt"}}
    assert placed == {""}  # a local model's step: no device given, as without psclient


# ------------------------------------ (e) sparse updates: row work, not table
#: A table size no other tensor of these steps has.
SPARSE_ROWS = 4099


def table_sized(concrete, rows=SPARSE_ROWS):
    """Ops with an output of `rows` rows (a full table or slot), resource handles aside."""
    return sorted(
        f"{op.type} {op.name} {out.shape}" for op in concrete.graph.get_operations() for out in op.outputs
        if out.dtype != tf.resource and out.shape.rank and out.shape[0] == rows
    )


def sparse_batches(n=STEPS, rows=SPARSE_ROWS):
    """Ids with duplicates in every batch (ids from 40 rows spread over the table), 16 x 8 per batch."""
    rng = np.random.default_rng(5)
    hot = rng.choice(rows, 40, replace=False)
    xs = [hot[rng.integers(0, 40, (16, 8))].astype("int32") for _ in range(n)]
    ys = [rng.integers(0, 4, 16).astype("int32") for _ in range(n)]
    for x in xs:
        assert len(np.unique(x)) < x.size  # duplicate ids in the batch
    return [(tf.constant(x), tf.constant(y)) for x, y in zip(xs, ys)]


@pytest.mark.parametrize("name", ["sgd", "adagrad"])
def test_sparse_update_of_a_ps_table_touches_rows_only(strategy, name):
    """No full-table op: Keras's Adagrad builds sqrt(accumulator + epsilon) over the table; psclient's does not."""
    data = sparse_batches(n=1)
    with strategy.scope():
        model = embedding_model(rows=SPARSE_ROWS)
        optimizer = OPTIMIZERS[name]()
        optimizer.build(model.trainable_variables)
        concrete = make_step(model, optimizer).get_concrete_function(*data[0])
    assert table_sized(concrete) == []
    graph = StepGraph(concrete, list(model.trainable_variables) + list(optimizer.variables))
    assert_updates_on_ps(graph, model, optimizer)
    table = model.layers[0].embeddings
    slots = [v for v in optimizer.variables if tuple(v.shape) == tuple(table.shape)]
    assert {op.type for op, _ in graph.writes([table, *slots])} == (
        {"ResourceScatterSub"} if name == "sgd" else {"ResourceScatterSub", "ResourceScatterAdd"}
    )
    # The same step of a model in this process: Keras's own update, whose
    # Adagrad works on the whole table (what the check above would catch).
    local = embedding_model(rows=SPARSE_ROWS)
    local_optimizer = OPTIMIZERS[name]()
    local_optimizer.build(local.trainable_variables)
    local_ops = table_sized(make_step(local, local_optimizer).get_concrete_function(*data[0]))
    if name == "adagrad":
        assert any(line.startswith("Sqrt ") for line in local_ops), local_ops


def test_sparse_adagrad_equals_local_keras_with_duplicate_ids(strategy):
    """Weights and accumulators after N sparse steps: bit-identical to a local Keras run.

    Keras's own arithmetic on the touched rows (each duplicate's square added
    to the accumulator, each duplicate's step subtracted, as Keras does); the
    untouched rows of the table and accumulator never change.
    """
    data = sparse_batches()
    keras.utils.set_random_seed(1)
    local = embedding_model(rows=SPARSE_ROWS)
    initial = [w.copy() for w in local.get_weights()]
    local_optimizer = keras.optimizers.Adagrad(0.1)
    local_optimizer.build(local.trainable_variables)
    local_step = make_step(local, local_optimizer)
    for x, y in data:
        local_step(x, y)

    with strategy.scope():
        model = embedding_model(rows=SPARSE_ROWS)
        model.set_weights(initial)
        optimizer = keras.optimizers.Adagrad(0.1)
        optimizer.build(model.trainable_variables)
        step = make_step(model, optimizer)
    for x, y in data:
        strategy.schedule(step, args=(x, y)).result(timeout=120)

    for got, expected in zip(model.get_weights(), local.get_weights()):
        np.testing.assert_array_equal(got, expected)
    for got, expected in zip(optimizer.variables, local_optimizer.variables):
        np.testing.assert_array_equal(got.numpy(), expected.numpy(), err_msg=got.path)
    touched = np.unique(np.concatenate([x.numpy().ravel() for x, _ in data]))
    untouched = np.setdiff1d(np.arange(SPARSE_ROWS), touched)
    table, accumulator = model.get_weights()[0], optimizer._accumulators[0].numpy()
    np.testing.assert_array_equal(table[untouched], initial[0][untouched])
    np.testing.assert_array_equal(accumulator[untouched], np.full((len(untouched), 16), 0.1, "float32"))
    assert np.all(table[touched] != initial[0][touched])
    assert int(optimizer.iterations.numpy()) == STEPS
