"""A cluster model's trainable weights read once per forward pass, not once per loop iteration.

Keras's recurrent layers (`LSTM`, `GRU`, `SimpleRNN`, any `RNN` not unrolled), like any
layer that loops with `tf.while_loop` or an autographed `for ... in tf.range(...)`, read
their weights inside the loop's body, once per iteration. Locally that read costs nothing.
With the weights on a ps task, TF places each read with its variable, so the ps takes part
in every iteration of the loop: the worker and the ps exchange the loop's state and the
weights at each timestep, forward and backward. Measured on this project's 2-core machine
(`benchmarks/keras_fit.py --model lstm`, docs/keras.md "Loops inside a layer"): an `LSTM(16)`
over 48 timesteps ran 15.0 steps/s on 2 workers and 1 ps, 110.9 with its reads out of the
loop, 158.0 in one process.

While the outermost layer call (a model's forward pass in `fit`, `evaluate`, `predict`
or a user's `train_step`) is traced, a trainable weight on a ps that is read inside a
while loop made during that call is read once, in the graph just outside the outermost
such loop, and the loop captures that tensor: one transfer per forward pass, and the loop
runs on the worker alone. The gradient flows through the loop to that one read, as TF
differentiates any tensor a loop captures.

What changes for the code of a layer: inside a loop of its call, a trainable weight reads
as it was when the loop started. A forward pass does not write its trainable weights (the
optimizer does, after it); a layer that assigned one inside a loop of its own call and read
it back in the same loop would see the value from before the loop. Non-trainable weights
(moving statistics, seed generators' states, counters), which calls do write, are read
where they are read, as before; so are weights read outside any loop, weights of a
partitioned variable, and weights in this process. `ops.take` on axis 0 (an `Embedding`'s
lookup) still gathers its rows on the ps inside the loop (`take_source`).
"""

from __future__ import annotations

import functools
import threading

import tensorflow as tf

from psclient._coordinator.training.updates import ps_device_of
from psclient._keras import seam
from psclient._tf.control_flow import graph_outside_loops, read_in

__all__ = ["install", "take_source"]

_state = threading.local()
_stock_value = None


class _ForwardPass:
    """The outermost layer call being traced: its graph and the reads moved out of its loops."""

    __slots__ = ("graph", "reads")

    def __init__(self, graph):
        self.graph = graph
        self.reads = {}  # (graph outside the loops, the tf.Variable's ref) -> the read


def take_source(variable):
    """What `ops.take` gathers from for a Keras `variable`: its tf.Variable (or Keras's own
    substitute in a stateless or autocast scope), never a read moved out of a loop."""
    if _stock_value is None:
        return variable.value
    return _stock_value.fget(variable)


def install() -> None:
    """Patch Keras's `Layer.__call__` (to mark the outermost call traced) and `Variable.value`."""
    global _stock_value
    from keras.src.backend.common.stateless_scope import in_stateless_scope
    from keras.src.backend.common.variables import Variable
    from keras.src.layers.layer import Layer

    stock_call = Layer.__call__
    stock_value = Variable.value

    @functools.wraps(stock_call)
    def __call__(self, *args, **kwargs):
        if getattr(_state, "forward", None) is not None or not tf.inside_function():
            return stock_call(self, *args, **kwargs)
        _state.forward = _ForwardPass(tf.compat.v1.get_default_graph())
        try:
            return stock_call(self, *args, **kwargs)
        finally:
            _state.forward = None

    def value(self):
        forward = getattr(_state, "forward", None)
        if forward is None or not self.trainable or in_stateless_scope():
            return stock_value.fget(self)
        variable = seam.internal(self, "_value")
        if not isinstance(variable, tf.Variable) or ps_device_of(variable) is None:
            return stock_value.fget(self)
        outside = graph_outside_loops(tf.compat.v1.get_default_graph(), forward.graph)
        if outside is None:
            return stock_value.fget(self)
        key = (outside, variable.ref())
        read = forward.reads.get(key)
        if read is None:
            read = forward.reads[key] = read_in(outside, variable)
        return self._maybe_autocast(read)

    Layer.__call__ = __call__
    Variable.value = property(value, doc=stock_value.__doc__)
    _stock_value = stock_value
