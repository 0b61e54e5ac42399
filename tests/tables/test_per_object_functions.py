"""A traced function made once per table shard says nothing of retracing (`_tf.functions`).

TF counts traces per code object, so the fifth shard's (or the fifth recovery's) own first trace
logged "triggered tf.function retracing. Tracing is expensive" in every chaos plan with a table.
No cluster: the count and the warning are the same in one process.
"""

import logging

import tensorflow as tf

from psclient._tf.functions import made_per_object


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _first_calls_of_many(wrap, count=8):
    logger = tf.get_logger()
    lines = _Lines()
    logger.addHandler(lines)
    try:
        for i in range(count):
            variable = tf.Variable(float(i))
            function = wrap(tf.function(lambda v=variable: v.read_value() + 1.0, autograph=False))
            assert float(function()) == i + 1.0
            assert function.experimental_get_tracing_count() == 1
    finally:
        logger.removeHandler(lines)
    return [line for line in lines.lines if "retracing" in line]


def test_functions_made_per_object_do_not_warn_of_retracing():
    assert _first_calls_of_many(made_per_object) == []


def test_without_it_tf_warns_at_the_fifth_function_of_the_same_code():
    # What the helper is for: TF still warns for plain functions (a TF that stops should fail here).
    assert _first_calls_of_many(lambda function: function)


def _tf_warnings_about(function_name):
    """TF's own retracing detector, called as TF's function calls it: the warnings it logs."""
    from tensorflow.python.eager.polymorphic_function import polymorphic_function

    logger = tf.get_logger()
    lines = _Lines()
    logger.addHandler(lines)
    try:
        detector = polymorphic_function._FrequentTracingDetector()
        for _ in range(6):
            detector.called_with_tracing(function_name, False)
    finally:
        logger.removeHandler(lines)
    return [line for line in lines.lines if "retracing" in line]


def test_the_warning_about_tfs_own_saver_is_dropped_and_no_other():
    from psclient._tf.functions import quiet_saver_retracing

    quiet_saver_retracing()
    quiet_saver_retracing()  # idempotent: one filter
    logger = logging.getLogger("tensorflow")
    assert sum(type(f).__name__ == "_SaverRetracing" for f in logger.filters) == 1
    saver = "<function MultiDeviceSaver.save.<locals>.tf_function_save at 0x7f2d5d04ef20>"
    assert _tf_warnings_about(saver) == []
    assert _tf_warnings_about("<function MultiDeviceSaver.restore.<locals>.tf_function_restore at 0x1>") == []
    assert _tf_warnings_about("<function train_step at 0x7f2d5d04ef20>")  # a user's function still warns


def test_a_function_traced_once_per_kind_of_argument_does_not_warn():
    from psclient._tf.functions import traced_per_signature

    lines = _Lines()
    tf.get_logger().addHandler(lines)
    try:
        function = traced_per_signature(tf.function(lambda v: tf.size(v), autograph=False))
        for dtype in (tf.float32, tf.int64, tf.int32, tf.float64, tf.int8, tf.int16, tf.uint8):
            assert int(function(tf.Variable(tf.zeros([3], dtype)))) == 3
        assert function.experimental_get_tracing_count() == 7
    finally:
        tf.get_logger().removeHandler(lines)
    assert [line for line in lines.lines if "retracing" in line] == []
