"""Partitioned variables: one variable cut along axis 0 into shards on several ps tasks.

`PartitionedVariable` is TF's `ShardedVariable` (what TF's own
ParameterServerStrategy creates; it converts to a tensor by concatenating its
shards, and splits `assign`, `assign_add/sub` and `scatter_*` per shard) made
usable as the value of a Keras 3 variable, which TF's is not:

- Keras 3's TF `Variable` acts as a resource variable: `GradientTape.gradient`
  asks it for `.handle`, which it forwards to its value. Here `.handle` is the
  partitioned variable itself, a composite whose gradient components are its
  shards' handles, and whose gradient is put back together as one gradient of
  the full shape: a dense tensor (shards concatenated) or, for an embedding,
  one `tf.IndexedSlices` with row indices of the full table. Keras's
  optimizers then see an ordinary gradient and update the variable through
  `assign`/`scatter_*`, which TF splits per shard.
- `.device` is the first shard's device, so `colocate_vars_with(variable)`
  (how a Keras optimizer places a slot) asks the variable creator for the
  first shard's ps task; the creator then puts slot shard `i` beside shard `i`
  (see `psclient._core.partitioning.shard_tasks`).
- `read_value()` and `__array__` give the full value (what a checkpoint
  and `model.save` write).

TF internals used here (no public equivalent): `sharded_variable.ShardedVariable`,
`composite_tensor_gradient.CompositeTensorGradient`.
"""

from __future__ import annotations

from typing import Any, Callable

from psclient._core.partitioning import row_ranges

__all__ = ["PartitionedVariable", "create_partitioned", "is_partitioned"]

_CLASS = None


def _class():
    """The class, built on first use (TensorFlow is imported lazily)."""
    global _CLASS
    if _CLASS is not None:
        return _CLASS
    import tensorflow as tf
    from tensorflow.python.distribute import sharded_variable
    from tensorflow.python.framework import composite_tensor_gradient, tensor_conversion_registry

    class _Gradient(composite_tensor_gradient.CompositeTensorGradient):
        def get_gradient_components(self, value):
            return [shard.handle for shard in value.variables]

        def replace_gradient_components(self, value, component_grads):
            return _full_gradient(value, component_grads)

    class PartitionedVariable(sharded_variable.ShardedVariable):
        """A variable cut along axis 0 into shards, each on its own ps task."""

        __composite_gradient__ = _Gradient()

        @property
        def handle(self):
            # GradientTape unwraps resource-like sources through `.handle`
            # (a Keras variable forwards it to its value); as a composite this
            # expands into the shards' handles.
            return self

        @property
        def device(self) -> str:
            return self.variables[0].device

        def read_value(self):
            return tf.concat([shard.read_value() for shard in self.variables], axis=0)

        def value(self):
            return self.read_value()

        def __array__(self, dtype=None, copy=None):
            # What Keras's `Variable.__array__` forwards to (model.save writes weights with it).
            value = self.read_value().numpy()
            return value if dtype is None else value.astype(dtype, copy=False)

        @property
        def shard_devices(self) -> list[str]:
            return [shard.device for shard in self.variables]

    def _to_tensor(value, dtype=None, name=None, as_ref=False):
        if as_ref:
            # `ops.colocate_with` in a graph asks for a reference op: the
            # first shard's (a slot then starts on the same ps task).
            return value.variables[0].handle
        return sharded_variable._var_to_tensor(value, dtype=dtype, name=name)  # noqa: SLF001

    # Before ShardedVariable's own (priority 100), which refuses as_ref.
    tensor_conversion_registry.register_tensor_conversion_function(PartitionedVariable, _to_tensor, priority=90)
    _CLASS = PartitionedVariable
    return _CLASS


def _full_gradient(value, grads):
    """The gradient of the whole variable from its shards' gradients."""
    import tensorflow as tf

    if all(grad is None for grad in grads):
        return None
    if not any(isinstance(grad, tf.IndexedSlices) for grad in grads):
        return tf.concat(
            [tf.zeros(shard.shape, shard.dtype) if grad is None else tf.convert_to_tensor(grad)
             for shard, grad in zip(value.variables, grads)],
            axis=0,
        )
    indices, values, offset = [], [], 0
    for shard, grad in zip(value.variables, grads):
        if grad is not None:
            if not isinstance(grad, tf.IndexedSlices):
                grad = tf.IndexedSlices(grad, tf.range(shard.shape[0], dtype=tf.int64))
            indices.append(tf.cast(grad.indices, tf.int64) + offset)
            values.append(grad.values)
        offset += shard.shape[0]
    return tf.IndexedSlices(
        tf.concat(values, axis=0), tf.concat(indices, axis=0),
        tf.constant(value.shape.as_list(), dtype=tf.int64),
    )


def is_partitioned(variable: Any) -> bool:
    return _CLASS is not None and isinstance(variable, _CLASS)


def create_partitioned(next_creator: Callable, kwargs: dict, value, devices: list[str]):
    """Create one shard per device from the full initial `value`; wrap them.

    `kwargs` are the `tf.Variable` arguments the creator received (the
    initial value already evaluated to `value`).
    """
    import tensorflow as tf

    cls = _class()
    name = kwargs.get("name") or "Variable"
    ranges = row_ranges(value.shape[0], len(devices))
    with tf.init_scope():  # the value is eager (evaluated by the creator): cut it eagerly
        parts = [value[start:stop] for start, stop in ranges]
    shards = []
    for index, (part, device) in enumerate(zip(parts, devices)):
        shard_kwargs = dict(kwargs, initial_value=part, name=f"{name}/part_{index}")
        shard_kwargs.pop("shape", None)
        with tf.device(device):
            shards.append(next_creator(**shard_kwargs))
    return cls(shards, name=name)
