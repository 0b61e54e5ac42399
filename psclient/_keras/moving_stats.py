"""Layer statistics that compose under asynchronous training.

Keras 3's `BatchNormalization` updates its moving statistics with a plain
read-then-`assign`: `moving_mean.assign(moving_mean * momentum + mean * (1 -
momentum))`. With several workers on the same ps variable, a worker's write
replaces whatever another worker wrote between its read and its write, so
updates are lost (measured: inputs with mean 5.0, momentum 0.99, 200 steps of
`fit` on 2 workers left the moving mean at 4.075 where 200 updates give 4.330).
tf_keras writes the same statistics as `assign_sub((var - value) * decay)`,
which loses none.

psclient does the same for a layer whose state is on a ps task: the layer's
`call` runs in a `keras.StatelessScope` that maps each state variable to one
value read at the start (the value the layer computes with, and reads anyway),
and collects what the layer assigns. Each new value is then written as one
atomic `tf.Variable.assign_sub(read - new)` on the variable's ps. Without
concurrent writers that leaves exactly the layer's new value; with them, each
worker's change is added on top of the others', as tf_keras's updates are.

Layers treated so (`STATEFUL_LAYERS`): `BatchNormalization`, whose training
call updates `moving_mean` and `moving_variance` (and with `renorm=True` also
`moving_stddev`, `renorm_mean`, `renorm_stddev`), all moving averages. Their
reads feed only the updates (and renorm's corrections, outside the gradient),
so the training math is Keras's. Other built-in layers that `assign` during a
training call are left as Keras writes them. `SpectralNormalization`
overwrites its wrapped layer's kernel with the normalized kernel and its
`vector_u` with a power-iteration estimate: the wrapped layer then computes,
and takes its gradient, with the kernel variable as written, which a mapped
read would change (the gradient would flow through the normalization); the
cost left is that a worker's optimizer update landing between another's read
and write of that kernel is overwritten. A stateful RNN (`stateful=True`)
keeps one sequence's states, which several workers cannot share
meaningfully. `Normalization`, `IndexLookup` and the other preprocessing
layers assign in `adapt()` only, not while training. The random layers
(`Dropout`, `GaussianNoise`, `RandomFlip`...) advance a `SeedGenerator`'s
state by read-then-assign: two workers' steps can draw the same seed (the
same dropout mask); an increment lost that way costs nothing further, and an
atomic increment would not make the read unique, so it is left too.

Inert (Keras's own call) for a layer with no state on a ps task, outside
training (`training` not True: inference reads its statistics and writes
none) and inside another `StatelessScope` (evaluate's, or Keras's symbolic
build), which collects the assigned values itself.
"""

from __future__ import annotations

import functools

import tensorflow as tf

from psclient._keras import seam

__all__ = ["STATEFUL_LAYERS", "install"]

#: The attributes of `BatchNormalization` that hold moving statistics (the
#: last three exist with `renorm=True` only).
STATEFUL_LAYERS = {
    "BatchNormalization": ("moving_mean", "moving_variance", "moving_stddev", "renorm_mean", "renorm_stddev"),
}


def install() -> None:
    """Wrap `BatchNormalization.call` (once: the caller installs once)."""
    from keras.src.layers.normalization.batch_normalization import BatchNormalization

    BatchNormalization.call = _composing_call(BatchNormalization.call, STATEFUL_LAYERS["BatchNormalization"])


def _composing_call(stock, names: tuple[str, ...]):
    import keras
    from keras.src.backend.common.stateless_scope import in_stateless_scope

    from psclient._coordinator.updates import ps_device_of

    def call(self, inputs, *args, **kwargs):
        training = kwargs.get("training", args[0] if args else None)
        if training is not True or in_stateless_scope():
            return stock(self, inputs, *args, **kwargs)
        state = []
        for name in names:
            variable = getattr(self, name, None)
            if isinstance(variable, keras.Variable) and ps_device_of(variable) is not None:
                state.append((variable, seam.internal(variable, "_value")))
        if not state:
            return stock(self, inputs, *args, **kwargs)
        # One read of each; the layer computes with it and the delta is taken from it.
        read = [(variable, tf_variable.read_value()) for variable, tf_variable in state]
        with keras.StatelessScope(state_mapping=read) as scope:
            outputs = stock(self, inputs, *args, **kwargs)
        for (variable, value), (_, tf_variable) in zip(read, state):
            new = scope.get_current_value(variable)
            if new is not value:  # assigned in the call
                tf_variable.assign_sub(value - tf.cast(new, tf_variable.dtype))
        # The scope holds back every assign in the call: one to another of the
        # layer's variables (a subclass's) is written as Keras would have.
        mapped = {id(variable) for variable, _ in state}
        for variable in self.variables:
            new = scope.get_current_value(variable) if id(variable) not in mapped else None
            if new is not None:
                variable.assign(new)
        return outputs

    functools.update_wrapper(call, stock)
    call.__doc__ = (
        f"{stock.__doc__ or ''}\n\nOn a ps task, the moving statistics are updated with one atomic "
        "assign_sub each (psclient)."
    )
    return call
