"""The one-kernel updates (psclient._keras.fused_updates) mark what they write, as Keras's ops did.

A big variable's checkpoint copy is taken before the cut, training going on,
and the cut reads again what was written since: marked rows, or the whole
variable once a dense write set its flag (docs/fault_tolerance.md, "The cut
does not grow with the embeddings"). `ResourceApplyAdam` is a raw op on the
variables' handles (so are the SGD kernels), which the marks' wrapped methods do not see: without its
own marks, a checkpoint could hold a big weight or slot older than its cut.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import psclient
from psclient._tf.write_marks import marks_of

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

INPUTS, UNITS = 2400, 1000  # a 9.6 MB kernel: above one row chunk (8 MiB), so marked
VALUE = "/.ATTRIBUTES/VARIABLE_VALUE"


@pytest.fixture(scope="module")
def cluster(two_workers_two_ps):
    return two_workers_two_ps


@pytest.mark.parametrize("name", ["adam", "sgd_momentum"])
def test_the_fused_update_marks_the_weight_and_its_slots_whole(cluster, tmp_path, name):
    import keras

    strategy = psclient.ParameterServerStrategy(cluster, checkpoint_dir=str(tmp_path / "ckpt"),
                                                variable_partitioner=None)
    try:
        with strategy.scope():
            layer = keras.layers.Dense(UNITS, use_bias=False)
            layer.build((None, INPUTS))
            optimizer = keras.optimizers.Adam(1e-2) if name == "adam" else keras.optimizers.SGD(1e-3, momentum=0.9)
            optimizer.build([layer.kernel])

            @tf.function
            def step(x):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(tf.square(layer(x)))
                optimizer.apply_gradients([(tape.gradient(loss, layer.kernel), layer.kernel)])
                return loss

        written = [layer.kernel.value] + [v.value for v in optimizer.variables
                                          if v.path.endswith(("_momentum", "_velocity"))]
        # The kernel and its slots: Adam's m and v, SGD's momentum.
        assert [tuple(v.shape) for v in written] == [(INPUTS, UNITS)] * (3 if name == "adam" else 2)
        graph = step.get_concrete_function(tf.TensorSpec([4, INPUTS])).graph
        kernel = "ResourceApplyAdam" if name == "adam" else "ResourceApplyKerasMomentum"
        assert kernel in {op.type for op in graph.get_operations()}
        for variable in written:
            assert marks_of(variable) is not None
            marks_of(variable).reset()
            assert marks_of(variable).flags().numpy().tolist() == [0, 0]

        x = np.random.default_rng(0).standard_normal((4, INPUTS)).astype("float32")
        strategy.schedule(step, args=(x,)).result(timeout=120)
        for variable in written:
            assert marks_of(variable).flags().numpy().tolist() == [0, 1], variable.name  # written whole

        # A checkpoint after the step holds the step's values (its copy, taken before the cut, read
        # again whole in the cut because of the marks).
        before = layer.kernel.numpy()
        strategy.schedule(step, args=(x,)).result(timeout=120)
        path = strategy.save_checkpoint()
        after = layer.kernel.numpy()
        assert not np.array_equal(before, after)
        reader = tf.train.load_checkpoint(path)
        saved = [reader.get_tensor(key) for key, shape in reader.get_variable_to_shape_map().items()
                 if key.endswith(VALUE) and shape == [INPUTS, UNITS]]
        assert any(np.array_equal(value, after) for value in saved)
        assert not any(np.array_equal(value, before) for value in saved)
    finally:
        strategy.shutdown()
