"""A ps SIGKILLed and started again while nothing runs: the next call recovers it and succeeds.

Between two calls no closure runs, so no closure's failure reports the lost
ps; the next call's own reads and writes of ps state on the coordinator meet
it first (fit/evaluate/predict's check of every ps, a trace sizing a dynamic
table's slots, Keras's metric resets, a checkpoint). Each goes through the
strategy's guarded access: the loss is reported, the ps restored from the
newest checkpoint (docs/fault_tolerance.md), and the access made again.

How "restored from the newest checkpoint" is checked: the model trains for
two epochs, then its learning rate is set to 0 and a checkpoint is taken,
so every later checkpoint holds the same weights and rows, and so does
every later call (fit with a learning rate of 0 moves nothing). A ps that
came back empty, or re-initialised, would hold other values: fresh weights,
and rows drawn again from their keys' initial values.

On the session's shared 2-worker, 2-ps cluster (every task runs again when
a test ends).
"""

import numpy as np
import pytest

import psclient
from _ps_ops import eager_ps_ops

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900),
              pytest.mark.usefixtures("restore_shared_clusters")]

_RNG = np.random.default_rng(40)
KEYS = _RNG.integers(0, 1000, (256, 1)).astype("int64")
FEATURES = _RNG.standard_normal((256, 6)).astype("float32")
LABELS = ((KEYS[:, 0] % 3 == 0) ^ (FEATURES[:, 0] > 0)).astype("float32")[:, None]
BATCH = 32


def dynamic_model():
    ids = keras.Input((1,), dtype="int64")
    rows = psclient.layers.DynamicEmbedding(8, capacity=4096, name="between_rows")(ids[:, 0])
    model = keras.Model(ids, keras.layers.Dense(1)(rows))
    model.compile(optimizer=keras.optimizers.Adagrad(0.3),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True), metrics=["accuracy"])
    return model, KEYS


def dense_model():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adagrad(0.3),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True), metrics=["accuracy"])
    return model, FEATURES


MODELS = {"dynamic_embedding": dynamic_model, "dense": dense_model}


def snapshot(model) -> dict:
    """The model's weights, and each DynamicEmbedding's rows by key (read from the ps)."""
    state = {f"weight {i}": np.array(w) for i, w in enumerate(model.get_weights())}
    for layer in model.layers:
        if isinstance(layer, psclient.layers.DynamicEmbedding):
            for shard in layer.export_state():
                for key, row in zip(shard["row_keys"].tolist(), shard["rows"]):
                    state[f"{layer.name} row {key}"] = np.array(row)
    return state


def assert_same(state, expected, when):
    assert state.keys() == expected.keys(), f"{when}: {sorted(set(state) ^ set(expected))[:5]}"
    differ = [name for name in expected if not np.array_equal(state[name], expected[name])]
    assert not differ, f"{when}: {len(differ)} of {len(expected)} values differ from the checkpoint's, e.g. {differ[:3]}"


def kill_and_restart(local, ps):
    """SIGKILL the ps and start it again at its address, as a supervisor does; nothing runs meanwhile."""
    local.kill("ps", ps)
    assert not local.is_running("ps", ps)
    local.restart("ps", ps, timeout=300)  # generous: a loaded machine starts TF slowly


def connect(local, tmp_path):
    """A strategy on the shared cluster, with checkpoints to recover from and generous waits."""
    return psclient.ParameterServerStrategy(local.cluster, checkpoint_dir=str(tmp_path / "ckpt"),
                                            hang_timeout=60, connect_timeout=300)


def recoveries(strategy):
    return [ps["recoveries"] for ps in strategy.stats()["ps"]]


@pytest.mark.long
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_fit_evaluate_and_save_checkpoint_each_recover_a_ps_lost_before_them(two_workers_two_ps, tmp_path, kind):
    local = two_workers_two_ps
    strategy = connect(local, tmp_path)
    try:
        with strategy.scope():
            model, x = MODELS[kind]()
        model.fit(x, LABELS, batch_size=BATCH, epochs=2, verbose=0)
        model.optimizer.learning_rate.assign(0.0)  # from here on every checkpoint holds these values
        first = strategy.save_checkpoint()
        expected = snapshot(model)
        evaluated = model.evaluate(x, LABELS, batch_size=BATCH, verbose=0, return_dict=True)
        assert recoveries(strategy) == [0, 0]

        kill_and_restart(local, 1)  # between two fits
        history = model.fit(x, LABELS, batch_size=BATCH, epochs=1, verbose=0)
        assert np.isfinite(history.history["loss"][0]), history.history
        assert recoveries(strategy) == [0, 1]
        assert_same(snapshot(model), expected, "after the fit that met the lost ps 1")

        kill_and_restart(local, 0)  # between fit and evaluate
        again = model.evaluate(x, LABELS, batch_size=BATCH, verbose=0, return_dict=True)
        assert recoveries(strategy) == [1, 1]
        for name, value in evaluated.items():
            np.testing.assert_allclose(again[name], value, rtol=1e-5, err_msg=name)
        assert_same(snapshot(model), expected, "after the evaluate that met the lost ps 0")

        kill_and_restart(local, 1)  # before save_checkpoint
        path = strategy.save_checkpoint()
        assert path != first and recoveries(strategy) == [1, 2]
        assert_same(snapshot(model), expected, "after the save_checkpoint that met the lost ps 1")
        if kind == "dynamic_embedding":
            tables = strategy.stats()["dynamic_embeddings"]["between_rows"]
            assert all(entry.get("available", True) for entry in tables), tables
            assert sum(entry["rows"] for entry in tables) == len(np.unique(KEYS)), tables
    finally:
        strategy.shutdown()


def _train_step_graphs_and_gradients() -> tuple[int, int]:
    """Training steps' graphs alive in this process, and TF's registered gradients."""
    import gc

    from tensorflow.python.framework import func_graph, ops

    gc.collect()
    graphs = sum(isinstance(o, func_graph.FuncGraph) and "train_step" in o.name for o in gc.get_objects())
    return graphs, len(ops._gradient_registry._registry)


def test_a_step_traced_again_after_each_ps_recovery_leaves_no_old_trace_alive(two_workers_two_ps, tmp_path):
    # Each ps recovery traces the training step again. Keras's optimizer reduces the step's
    # gradients in the replica context, and TF's reduction registered a gradient per trace in its
    # process-wide registry, which kept every old trace alive (13,000 objects a recovery).
    local = two_workers_two_ps
    strategy = connect(local, tmp_path)
    try:
        with strategy.scope():
            model, x = dense_model()
        model.fit(x, LABELS, batch_size=BATCH, epochs=1, verbose=0)
        alive = []
        for ps in (1, 0, 1):
            strategy.save_checkpoint()
            kill_and_restart(local, ps)
            model.fit(x, LABELS, batch_size=BATCH, epochs=1, verbose=0)  # meets the lost ps, traces again
            alive.append(_train_step_graphs_and_gradients())
        assert recoveries(strategy) == [1, 2]
        assert alive[1] == alive[0] and alive[2] == alive[0], alive  # (graphs, gradients) after each
    finally:
        strategy.shutdown()


def test_a_trace_that_reads_a_lost_ps_is_made_again_once_the_ps_is_restored(two_workers_two_ps, tmp_path):
    # What DynamicEmbedding's trace does (the size of a table's rows, read under init_scope to
    # make its slots), on a plain variable: the read at trace time is the call's first contact
    # with the restarted ps, before any closure runs.
    local = two_workers_two_ps
    strategy = psclient.ParameterServerStrategy(local.cluster, checkpoint_dir=str(tmp_path / "ckpt"),
                                                hang_timeout=60, connect_timeout=300, variable_partitioner=None)
    try:
        with strategy.scope(), tf.device("/job:ps/task:1"):
            rows = tf.Variable(tf.range(5, dtype=tf.float32))
        rows.assign_add(tf.ones([5]))
        strategy.save_checkpoint()  # holds [1, 2, 3, 4, 5]
        traces, sizes = [], []

        @tf.function(autograph=False)
        def step():
            traces.append("started")
            with tf.init_scope():
                sizes.append(int(tf.shape(rows.read_value())[0]))  # an eager read of ps 1 while tracing
            return rows * 2.0

        kill_and_restart(local, 1)
        with eager_ps_ops() as ops:
            result = strategy.schedule(step).result(timeout=300)
        np.testing.assert_array_equal(result, [2.0, 4.0, 6.0, 8.0, 10.0])  # the checkpoint's, restored
        assert recoveries(strategy)[1] == 1
        assert len(traces) >= 2 and sizes == [5], (traces, sizes)  # the failed trace, then the one made again
        assert ops and all(op.guarded for op in ops), "\n".join(map(str, ops))
    finally:
        strategy.shutdown()


@pytest.mark.parametrize("mode", ["part", "all"])
def test_a_nested_tf_function_runs_again_after_a_ps_recovery(two_workers_two_ps, tmp_path, mode):
    """A scheduled step that calls another `tf.function` (a helper, a step inside a loop of steps),
    and that helper called on the coordinator: both run on the restored variable after ps 1 comes
    back. Before, the helper kept its trace of the lost ps's handle, every step failed with "Unable
    to find the relevant tensor remote_handle" and `join` raised (docs/fault_tolerance.md)."""
    local = two_workers_two_ps
    strategy = psclient.ParameterServerStrategy(local.cluster, checkpoint_dir=str(tmp_path / "ckpt"),
                                                hang_timeout=60, connect_timeout=300, ps_recovery=mode)
    try:
        with strategy.scope():
            with tf.device("/job:ps/task:0"):
                on_ps0 = tf.Variable(0, dtype=tf.int64)
            with tf.device("/job:ps/task:1"):
                on_ps1 = tf.Variable(0, dtype=tf.int64)

        @tf.function
        def count():  # the helper: called in the step's trace, and on its own
            on_ps1.assign_add(1)
            return on_ps1.read_value()

        @tf.function
        def step():
            on_ps0.assign_add(1)
            return count()

        for _ in range(4):
            strategy.schedule(step)
        strategy.join(timeout=120)
        assert int(count()) == 5  # traced before the loss, eagerly too
        strategy.save_checkpoint()  # ps 1's counter at 5
        kill_and_restart(local, 1)
        assert int(strategy.schedule(step).result(timeout=300)) == 6  # restored to 5, then counted
        for _ in range(3):
            strategy.schedule(step)
        strategy.join(timeout=120)
        assert int(count()) == 10
        assert recoveries(strategy) == [0, 1]
        if mode == "all":  # ps 0 back at the checkpoint's 4 too, then the 4 steps since
            assert int(on_ps0.numpy()) == 8
        else:  # ps 0 kept its count, and the attempts that met the lost ps counted on it too
            assert int(on_ps0.numpy()) >= 8
    finally:
        strategy.shutdown()


def test_every_eager_op_the_caller_makes_on_a_ps_is_guarded(two_workers_two_ps, tmp_path):
    """fit, evaluate, predict, checkpoints, stats() and a table's export, with nothing lost:
    every op the caller's thread runs on a ps task runs inside the guarded access."""
    local = two_workers_two_ps
    strategy = connect(local, tmp_path)
    try:
        with strategy.scope():
            model, x = dynamic_model()
        callback = psclient.ModelCheckpoint(str(tmp_path / "model_ckpt"))
        with eager_ps_ops() as ops:
            model.fit(x, LABELS, batch_size=BATCH, epochs=2, verbose=0, callbacks=[callback])
            model.fit(x, LABELS, batch_size=BATCH, epochs=1, verbose=0)
            model.evaluate(x, LABELS, batch_size=BATCH, verbose=0)
            model.predict(x, batch_size=BATCH, verbose=0)
            strategy.save_checkpoint()
            strategy.stats()
            model.get_layer("between_rows").export_state()
        assert callback.saved
        kinds = {op.op for op in ops}
        assert {"ReadVariableOp", "AssignVariableOp"} <= kinds, kinds  # the listing sees the calls' ops
        unguarded = [op for op in ops if not op.guarded]
        assert not unguarded, f"{len(unguarded)} of {len(ops)} ops unguarded:\n" + "\n".join(
            sorted({str(op) for op in unguarded}))
    finally:
        strategy.shutdown()
