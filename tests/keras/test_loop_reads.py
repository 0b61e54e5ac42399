"""A cluster model's trainable weights read once per forward pass, not once per loop iteration.

Keras's LSTM reads its kernels inside TF's while loop; with the kernels on a ps, each
iteration read them from the ps (`psclient._keras.loop_reads`). Checked here: the loop
bodies of a traced forward pass hold no read of a ps variable, gradients through the loop
equal a local model's with the same weights, a loop around whole steps (an optimizer's
update inside each iteration) still reads each step's weights afresh, and a lookup in a loop
still gathers its rows on the ps.
"""

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

pytestmark = pytest.mark.timeout(300)

TIMESTEPS, FEATURES, UNITS, BATCH = 12, 3, 8, 16
RNG = np.random.default_rng(7)
X = RNG.normal(size=(BATCH, TIMESTEPS, FEATURES)).astype("float32")
Y = RNG.normal(size=(BATCH, 1)).astype("float32")


def lstm_model():
    inputs = keras.Input((TIMESTEPS, FEATURES))
    return keras.Model(inputs, keras.layers.Dense(1)(keras.layers.LSTM(UNITS)(inputs)))


def gru_model():
    inputs = keras.Input((TIMESTEPS, FEATURES))
    return keras.Model(inputs, keras.layers.Dense(1)(keras.layers.GRU(UNITS)(inputs)))


def masked_bidirectional_model():
    """A SimpleRNN both ways over sequences padded with zeros (masked)."""
    inputs = keras.Input((TIMESTEPS, FEATURES))
    masked = keras.layers.Masking(0.0)(inputs)
    return keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Bidirectional(keras.layers.SimpleRNN(UNITS))(masked)))


def mixed_precision_lstm_model():
    """The LSTM computing in float16 from float32 weights (Keras casts each read)."""
    inputs = keras.Input((TIMESTEPS, FEATURES))
    hidden = keras.layers.LSTM(UNITS, dtype="mixed_float16")(inputs)
    return keras.Model(inputs, keras.layers.Dense(1)(keras.ops.cast(hidden, "float32")))


#: Each model's trainable weights (the recurrent layer's, then Dense's kernel and bias) and the
#: tolerance of its gradients against local Keras's.
RECURRENT = {"lstm": (lstm_model, 5, 1e-4), "gru": (gru_model, 5, 1e-4),
             "bidirectional_masked": (masked_bidirectional_model, 8, 1e-4),
             "lstm_mixed_float16": (mixed_precision_lstm_model, 5, 1e-2)}
X_PADDED = X.copy()
X_PADDED[: BATCH // 2, -4:] = 0.0  # half the sequences end 4 timesteps early


def loop_functions(graph_def):
    """The function bodies of the while loops (v2) of a traced function, by name."""
    loop_names = set()
    for function in graph_def.library.function:
        for node in function.node_def:
            if node.op in ("While", "StatelessWhile"):
                loop_names.update((node.attr["body"].func.name, node.attr["cond"].func.name))
    for node in graph_def.node:
        if node.op in ("While", "StatelessWhile"):
            loop_names.update((node.attr["body"].func.name, node.attr["cond"].func.name))
    return {f.signature.name: f for f in graph_def.library.function if f.signature.name in loop_names}


def ops_in(function):
    return [node.op for node in function.node_def]


def gradients_fn(model, loss_fn):
    @tf.function
    def gradients(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        return loss, tape.gradient(loss, model.trainable_variables)
    return gradients


@pytest.mark.parametrize("kind", list(RECURRENT))
def test_a_recurrent_step_reads_its_ps_kernels_outside_the_loop_with_the_local_gradients(strategy, kind):
    build, weights, tolerance = RECURRENT[kind]
    x = X_PADDED if kind == "bidirectional_masked" else X
    local = build()
    with strategy.scope():
        model = build()
    model.set_weights(local.get_weights())
    assert all(v.value.device.startswith("/job:ps/") for v in model.trainable_variables)
    loss_fn = keras.losses.MeanSquaredError()

    remote = gradients_fn(model, loss_fn)
    traced = remote.get_concrete_function(tf.TensorSpec(X.shape), tf.TensorSpec(Y.shape))
    loops = loop_functions(traced.graph.as_graph_def())
    assert loops, f"no while loop in the traced {kind} step"
    assert not [name for name, f in loops.items() if "ReadVariableOp" in ops_in(f)], \
        f"a read of a ps variable is still inside the {kind} loop"

    loss, grads = strategy.schedule(remote, args=(x, Y)).result(timeout=120)
    local_loss, local_grads = gradients_fn(local, loss_fn)(x, Y)
    np.testing.assert_allclose(loss, local_loss.numpy(), rtol=tolerance / 10)
    assert len(grads) == len(local_grads) == weights
    for got, want, variable in zip(grads, local_grads, local.trainable_variables):
        np.testing.assert_allclose(got, want.numpy(), rtol=tolerance, atol=tolerance / 100, err_msg=variable.path)
    np.testing.assert_allclose(model.predict(x, verbose=0), local.predict(x, verbose=0), rtol=tolerance / 10,
                               atol=tolerance / 100)


def test_a_loop_of_whole_steps_reads_each_steps_weights_afresh(strategy):
    """Three SGD steps in one traced loop (as `steps_per_execution` runs them): the forward pass
    is inside the loop, so each step reads the weights the step before wrote."""
    learning_rate, steps = 0.5, 3

    def run_steps(model):
        @tf.function
        def steps_in_a_loop(x, y):
            for _ in tf.range(steps):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
                for variable, grad in zip(model.trainable_variables, tape.gradient(loss, model.trainable_variables)):
                    variable.assign_sub(learning_rate * grad)
            return loss
        return steps_in_a_loop

    local = lstm_model()
    with strategy.scope():
        model = lstm_model()
    model.set_weights(local.get_weights())
    loss = strategy.schedule(run_steps(model), args=(X, Y)).result(timeout=120)
    local_loss = run_steps(local)(X, Y)
    np.testing.assert_allclose(loss, local_loss.numpy(), rtol=1e-4)
    for got, want in zip(model.get_weights(), local.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert not np.allclose(model.get_weights()[0], lstm_model().get_weights()[0])


class LookupsInALoop(keras.layers.Layer):
    """Per timestep: a row of `table` by id, times `kernel`, summed over the timesteps."""

    def build(self, shape):
        self.table = self.add_weight(shape=(50, 4), initializer="uniform", name="table")
        self.kernel = self.add_weight(shape=(4, 4), initializer="glorot_uniform", name="kernel")

    def call(self, ids):
        def body(t, total):
            rows = keras.ops.take(self.table, ids[:, t], axis=0)
            return t + 1, total + keras.ops.matmul(rows, self.kernel)

        _, total = tf.while_loop(lambda t, total: t < tf.shape(ids)[1], body,
                                 [tf.constant(0), tf.zeros((tf.shape(ids)[0], 4))])
        return total


def test_a_lookup_in_a_loop_still_gathers_its_rows_on_the_ps(strategy):
    with strategy.scope():
        layer = LookupsInALoop()
        model = keras.Sequential([keras.Input((5,), dtype="int32"), layer])
    ids = np.arange(20, dtype="int32").reshape(4, 5)

    forward = tf.function(lambda x: model(x))
    loops = loop_functions(forward.get_concrete_function(tf.TensorSpec((4, 5), tf.int32)).graph.as_graph_def())
    body_ops = [op for f in loops.values() for op in ops_in(f)]
    assert "ResourceGather" in body_ops, body_ops
    assert "ReadVariableOp" not in body_ops, body_ops

    table, kernel = layer.table.numpy(), layer.kernel.numpy()
    expected = sum(table[ids[:, t]] @ kernel for t in range(5))
    got = strategy.schedule(forward, args=(ids,)).result(timeout=120)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
