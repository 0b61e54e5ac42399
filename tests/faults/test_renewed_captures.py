"""tf.functions that captured a renewed variable handle trace again; others keep their traces.

In one process, no cluster: `renew_handle` gives a local variable a new resource as a ps recovery
does on the ps (psclient/_tf/renewed_captures.py). Locally the old resource stays readable (its
handle keeps it alive), so a stale trace shows as the old value, where on a cluster it fails (the
cluster test: tests/faults/test_ps_loss_between_calls.py, the nested tf.function).
"""

import gc
import weakref

import pytest

tf = pytest.importorskip("tensorflow")

from psclient._tf.renewed_captures import renewals  # noqa: E402
from psclient._tf.variables import renew_handle  # noqa: E402


def renewed(variable, value):
    renew_handle(variable, "/cpu:0")
    variable.assign(value)


def test_nested_outer_and_eager_calls_trace_again_with_the_new_handle():
    v = tf.Variable(1.0)
    traces = []

    @tf.function
    def inner():
        traces.append("inner")
        return v.read_value()

    @tf.function
    def outer():
        return inner() * 2.0

    assert float(inner()) == 1.0 and float(outer()) == 2.0
    before = renewals()
    renewed(v, 5.0)
    assert renewals() == before + 1
    assert float(inner()) == 5.0  # eagerly: the helper's new trace
    assert float(outer()) == 10.0  # its trace held the old handle through the helper's
    assert float(tf.function(outer.python_function)()) == 10.0  # a new outer (as schedule's) inlines the new helper
    calls_after = len(traces)
    assert float(inner()) == 5.0 and float(outer()) == 10.0
    assert len(traces) == calls_after  # traced once per renewal, not at every call


def test_a_function_of_other_variables_keeps_its_trace():
    v, w = tf.Variable(1.0), tf.Variable(2.0)
    traces = []

    @tf.function
    def of_w():
        traces.append("traced")
        return w * 3.0

    assert float(of_w()) == 6.0
    renewed(v, 7.0)
    assert float(of_w()) == 6.0 and traces == ["traced"]
    # Its verdict does not hold the function itself: freed when dropped, not at a collection.
    gc.disable()
    try:
        dropped = weakref.ref(of_w)
        del of_w
        assert dropped() is None
    finally:
        gc.enable()


def test_a_function_that_created_its_variable_is_not_traced_again():
    # A second trace would create a second variable, without the first one's state: left as it was.
    v = tf.Variable(1.0)
    made, traces = [], []

    @tf.function
    def makes_one():
        traces.append("traced")
        if not made:
            made.append(tf.Variable(10.0))
        return made[0] + v

    assert float(makes_one()) == 11.0
    traced = len(traces)  # TF traces such a function twice at its first call, by design
    renewed(v, 5.0)
    assert float(makes_one()) == 11.0  # its trace, and the old handle's value (on a cluster: a failure)
    assert len(traces) == traced and len(made) == 1
