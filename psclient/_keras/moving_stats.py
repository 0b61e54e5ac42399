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
and collects what the layer assigns. Each new value of a moving average is
then written as one atomic `tf.Variable.assign_sub(read - new)` on the
variable's ps. Without concurrent writers that leaves exactly the layer's new
value; with them, each worker's change is added on top of the others', as
tf_keras's updates are.

Layers treated so (`STATEFUL_LAYERS`): `BatchNormalization`, whose training
call updates `moving_mean` and `moving_variance` (and with `renorm=True` also
`moving_stddev`, `renorm_mean`, `renorm_stddev`). Their reads feed only the
updates (and renorm's corrections, outside the gradient), so the training
math is Keras's. All are moving averages, written as deltas, except one
(`DERIVED`): with `renorm=True` Keras does not average `moving_variance`, it
sets it to `relu(new_moving_stddev**2 - epsilon)`. As a delta, `variance +=
f(stddev_new) - variance_read`, that would add into `moving_variance` for
good every difference between the two reads (another worker's write landing
between them), and `moving_variance` would drift away from
`moving_stddev**2 - epsilon`. So a derived variable is written with a plain
`assign` of its derivation from its source as it is on the ps after this
worker's atomic update of the source (a read ordered after that
`assign_sub`), written after all the deltas. The race left: two workers
update `moving_stddev`, each then derives; the last to write
`moving_variance` may have read the stddev before the other's update landed,
so `moving_variance` can lag one `moving_stddev` update of another worker.
The next write replaces it: the lag never accumulates.

Other built-in layers that `assign` during a training call are left as Keras
writes them. `SpectralNormalization` overwrites its wrapped layer's kernel
with the normalized kernel and its `vector_u` with a power-iteration estimate: the wrapped layer then computes,
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
import types
from typing import Any, Callable, NamedTuple

import tensorflow as tf

from psclient._keras import seam

__all__ = ["DERIVED", "Derived", "STATEFUL_LAYERS", "install"]

#: The attributes of `BatchNormalization` that hold moving statistics (the
#: last three exist with `renorm=True` only).
STATEFUL_LAYERS = types.MappingProxyType({
    "BatchNormalization": ("moving_mean", "moving_variance", "moving_stddev", "renorm_mean", "renorm_stddev"),
})


class Derived(NamedTuple):
    """A state variable that the layer sets from another one, rather than averages."""

    #: The attribute it is derived from, itself written as a delta first.
    source: str
    #: `applies(layer)`: whether this layer derives it (otherwise it is a delta).
    applies: Callable[[Any], bool]
    #: `value(layer, source_value)`: the derivation, as the layer computes it.
    value: Callable[[Any, tf.Tensor], tf.Tensor]


#: Per layer class (a key of `STATEFUL_LAYERS`): attribute -> how it is derived.
DERIVED = types.MappingProxyType({
    "BatchNormalization": {
        # Keras's `_update_renorm_statistics`: relu(new_moving_stddev**2 - epsilon).
        "moving_variance": Derived(
            source="moving_stddev",
            applies=lambda layer: bool(getattr(layer, "renorm", False)),  # Keras 3.10 has no renorm
            value=lambda layer, stddev: tf.nn.relu(stddev * stddev - layer.epsilon),
        ),
    },
})


def install() -> None:
    """Wrap `BatchNormalization.call` (once: the caller installs once)."""
    from keras.src.layers.normalization.batch_normalization import BatchNormalization

    name = "BatchNormalization"
    BatchNormalization.call = _composing_call(BatchNormalization.call, STATEFUL_LAYERS[name], DERIVED.get(name, {}))


def _composing_call(stock, names: tuple[str, ...], derived: dict[str, Derived]):
    import keras
    from keras.src.backend.common.stateless_scope import in_stateless_scope

    from psclient._coordinator.training.updates import ps_device_of

    def call(self, inputs, *args, **kwargs):
        training = kwargs.get("training", args[0] if args else None)
        if training is not True or in_stateless_scope():
            return stock(self, inputs, *args, **kwargs)
        state = {}  # attribute -> (Keras variable, its tf.Variable on a ps)
        for name in names:
            variable = getattr(self, name, None)
            if isinstance(variable, keras.Variable) and ps_device_of(variable) is not None:
                state[name] = (variable, seam.internal(variable, "_value"))
        if not state:
            return stock(self, inputs, *args, **kwargs)
        # One read of each; the layer computes with it and the delta is taken from it.
        read = {name: tf_variable.read_value() for name, (_, tf_variable) in state.items()}
        mapping = [(state[name][0], value) for name, value in read.items()]
        with keras.StatelessScope(state_mapping=mapping) as scope:
            outputs = stock(self, inputs, *args, **kwargs)
        _write(self, state, read, scope, {name: d for name, d in derived.items() if d.applies(self)})
        # The scope holds back every assign in the call: one to another of the
        # layer's variables (a subclass's) is written as Keras would have.
        mapped = {id(variable) for variable, _ in state.values()}
        for variable in self.variables:
            new = scope.get_current_value(variable) if id(variable) not in mapped else None
            if new is not None:
                variable.assign(new)
        return outputs

    functools.update_wrapper(call, stock)
    call.__doc__ = (
        f"{stock.__doc__ or ''}\n\nOn a ps task, the moving statistics are updated with one atomic "
        "assign_sub each, and a statistic derived from another (renorm's moving_variance) is assigned "
        "its derivation from the other as it is after that update (psclient)."
    )
    return call


def _write(layer, state, read, scope, derived: dict[str, Derived]) -> None:
    """Writes what the layer assigned in `scope`: each moving average as one atomic delta
    from its read, then each derived variable (`derived`, the ones this layer derives) as
    its derivation from its source's value after this worker's delta."""
    sources = {d.source for d in derived.values()}
    after = {}  # source attribute -> its value on the ps, read after this worker's delta
    for name, (variable, tf_variable) in state.items():
        new = scope.get_current_value(variable)
        if name in derived or new is read[name]:  # derived, or not assigned in the call
            continue
        delta = read[name] - tf.cast(new, tf_variable.dtype)
        if name in sources:
            after[name] = tf.convert_to_tensor(tf_variable.assign_sub(delta, read_value=True))
        else:
            tf_variable.assign_sub(delta, read_value=False)
    for name, how in derived.items():
        variable, tf_variable = state.get(name, (None, None))
        if variable is None or scope.get_current_value(variable) is read[name]:
            continue  # not on a ps, or not assigned in the call
        source = after.get(how.source)
        if source is None:  # the source was not assigned in the call: as it is now
            source = seam.internal(getattr(layer, how.source), "_value").read_value()
        tf_variable.assign(tf.cast(how.value(layer, source), tf_variable.dtype))
