"""Keras 3 weights and slots initialised on their ps task, shard by shard when partitioned.

Keras's TF backend creates a variable as `tf.Variable(lambda: initializer(shape,
dtype))`: the shape and dtype are known before the value is made, but hidden
in the lambda. `install()` wraps Keras's `Variable._initialize_with_initializer`
so that, while Keras creates the `tf.Variable`, the strategy's variable
creator finds a description of it (`psclient._coordinator.variables.initial_values`):
shape, dtype, and for an elementwise initializer how to make one shard. The
creator then runs the initializer under the variable's ps device (or each
shard's), so the value is never made in the coordinator. Keras's own code runs
unchanged; outside a psclient scope the description is unused and dropped.

`shard_function` says how to make a shard of a partitioned variable with the
statistics of the full variable: Zeros, Ones and a scalar Constant are the
same for every shape; RandomUniform, RandomNormal and TruncatedNormal draw
each element independently; the VarianceScaling family (Glorot*, He*, Lecun*)
draws from a distribution whose scale comes from the fans of the FULL shape,
computed with Keras's own `compute_fans`. Each shard gets its own seed derived
from the initializer's (a seeded Keras initializer repeats its values for the
same seed: shards would be copies of each other). So a seeded initializer on a
partitioned variable gives values that depend on the number of shards, as with
TF's own strategy; a whole variable gets exactly Keras's values. Any other
initializer (Orthogonal, Identity, a subclass that overrides `__call__`, a
function) returns None: the full value is made once on the first shard's ps
and sliced there.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

from psclient._coordinator.variables import initial_values
from psclient._keras import seam

__all__ = ["install", "shard_function"]

# sqrt(variance) of a standard normal truncated to [-2, 2]: Keras's and TF's
# correction so a truncated normal keeps the intended standard deviation.
_TRUNCATED_STDDEV = 0.87962566103423978


def install() -> None:
    """Describe each Keras variable to psclient's creator while Keras creates it (class-level, once)."""
    from keras.src.backend.tensorflow.core import Variable

    stock = Variable._initialize_with_initializer

    def _initialize_with_initializer(self, initializer):
        shape = tuple(seam.internal(self, "_shape"))
        dtype = seam.internal(self, "_dtype")
        spec = initial_values.InitSpec(shape, dtype, shard_function(initializer, shape, dtype))
        with initial_values.describing(spec):
            return stock(self, initializer)

    functools.update_wrapper(_initialize_with_initializer, stock)
    _initialize_with_initializer.__doc__ = (
        f"{stock.__doc__ or ''} The value is made on the variable's ps task (psclient).")
    Variable._initialize_with_initializer = _initialize_with_initializer


def _same_call(initializer, cls) -> bool:
    """Whether `initializer` is a `cls` whose values Keras's own `cls.__call__` makes."""
    return isinstance(initializer, cls) and type(initializer).__call__ is cls.__call__


def shard_function(initializer: Any, full_shape: tuple, dtype: Any) -> Callable[[tuple, int], Any] | None:
    """`f(shard_shape, index)`: shard `index` of a `full_shape` variable, or None (not elementwise)."""
    from keras import initializers, random

    if any(_same_call(initializer, cls) for cls in (initializers.Zeros, initializers.Ones)):
        return lambda shape, index: initializer(shape, dtype=dtype)
    if _same_call(initializer, initializers.Constant):
        import numpy as np

        from keras import ops

        if np.ndim(initializer.value) != 0:
            return None  # an array broadcast to the full shape: not the same for every shard
        # The same values as Keras's `cast(value) * ones(shape)`, without
        # its temporary of the shard's size on the ps.
        return lambda shape, index: ops.full(shape, ops.cast(initializer.value, dtype), dtype=dtype)
    if _same_call(initializer, initializers.RandomUniform):
        return lambda shape, index: random.uniform(
            shape, minval=initializer.minval, maxval=initializer.maxval, dtype=dtype,
            seed=_shard_seed(initializer.seed, index))
    if _same_call(initializer, initializers.RandomNormal):
        return lambda shape, index: random.normal(
            shape, mean=initializer.mean, stddev=initializer.stddev, dtype=dtype,
            seed=_shard_seed(initializer.seed, index))
    if _same_call(initializer, initializers.TruncatedNormal):
        return lambda shape, index: random.truncated_normal(
            shape, mean=initializer.mean, stddev=initializer.stddev, dtype=dtype,
            seed=_shard_seed(initializer.seed, index))
    if _same_call(initializer, initializers.VarianceScaling):
        return _variance_scaling(initializer, full_shape, dtype)
    return None


def _variance_scaling(initializer, full_shape: tuple, dtype) -> Callable[[tuple, int], Any]:
    """Keras's VarianceScaling arithmetic, its scale from the fans of `full_shape`."""
    from keras import random
    from keras.src.initializers.random_initializers import compute_fans

    axes = {name: getattr(initializer, name) for name in ("input_axes", "output_axes")
            if getattr(initializer, name, None) is not None}
    fan_in, fan_out = compute_fans(full_shape, **axes)
    scale = initializer.scale
    if initializer.mode == "fan_in":
        scale /= max(1.0, fan_in)
    elif initializer.mode == "fan_out":
        scale /= max(1.0, fan_out)
    else:
        scale /= max(1.0, (fan_in + fan_out) / 2.0)
    if initializer.distribution == "truncated_normal":
        stddev = math.sqrt(scale) / _TRUNCATED_STDDEV
        return lambda shape, index: random.truncated_normal(
            shape, mean=0.0, stddev=stddev, dtype=dtype, seed=_shard_seed(initializer.seed, index))
    if initializer.distribution == "untruncated_normal":
        stddev = math.sqrt(scale)
        return lambda shape, index: random.normal(
            shape, mean=0.0, stddev=stddev, dtype=dtype, seed=_shard_seed(initializer.seed, index))
    limit = math.sqrt(3.0 * scale)
    return lambda shape, index: random.uniform(
        shape, minval=-limit, maxval=limit, dtype=dtype, seed=_shard_seed(initializer.seed, index))


def _shard_seed(seed, index: int):
    """Shard `index`'s seed: an integer seed mixed with the index; a SeedGenerator advances by itself."""
    if isinstance(seed, int):
        # A fixed odd multiplier spreads consecutive shards over the 32-bit range.
        return (seed + (index + 1) * 0x9E3779B1) % (1 << 31)
    return seed
