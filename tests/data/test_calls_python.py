"""Which tf.data pipelines call this process's Python (so fit reads them on the coordinator)."""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from psclient._tf.data import calls_python  # noqa: E402


def _rows():
    yield from np.arange(4, dtype="float32")


def _from_generator():
    return tf.data.Dataset.from_generator(_rows, output_signature=tf.TensorSpec((), tf.float32))


@pytest.mark.parametrize("make, expected", [
    (lambda: tf.data.Dataset.from_tensor_slices(np.arange(4.0)).map(lambda x: x * 2).batch(2), False),
    (lambda: tf.data.Dataset.range(4).shuffle(4).filter(lambda x: x > 0).batch(2), False),
    (lambda: _from_generator().batch(2).prefetch(1), True),
    (lambda: tf.data.Dataset.range(4).map(lambda x: tf.py_function(lambda v: v * 2, [x], tf.int64)), True),
    (lambda: tf.data.Dataset.range(4).map(lambda x: tf.numpy_function(lambda v: v * 2, [x], tf.int64)), True),
    # Inside another dataset's function, and behind a zip.
    (lambda: tf.data.Dataset.range(2).interleave(lambda _: _from_generator(), cycle_length=2), True),
    (lambda: tf.data.Dataset.zip((tf.data.Dataset.range(4), _from_generator())), True),
], ids=["graph-only", "shuffle-filter", "from_generator", "py_function", "numpy_function", "interleaved",
        "zipped"])
def test_pipelines_that_call_python_are_told_apart(make, expected):
    assert calls_python(make()) is expected
