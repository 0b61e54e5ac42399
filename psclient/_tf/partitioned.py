"""`PartitionedVariable`: TF's `ShardedVariable` made usable as a Keras 3 variable's value.

TF's `ShardedVariable` (what TF's own ParameterServerStrategy creates) converts
to a tensor by concatenating its shards and splits `assign`, `assign_add/sub`
and `scatter_*` per shard. Keras 3's TF `Variable` acts as a resource
variable, which TF's is not; here:

- `.handle` is the partitioned variable itself, a composite whose gradient
  components are its shards' handles, and whose gradient is put back together
  as one gradient of the full shape: a dense tensor (shards concatenated) or,
  for an embedding, one `tf.IndexedSlices` with row indices of the full table.
  Keras's optimizers then see an ordinary gradient.
- `.device` is the first shard's device, so `colocate_vars_with(variable)`
  asks the variable creator for the first shard's ps task.
- `read_value()` and `__array__` give the full value (what a checkpoint and
  `model.save` write); a checkpoint holds it whole, as one variable. During
  an export (`psclient._tf.serving`) a SavedModel holds it under the same
  one key, written as one slice per shard by the ps that holds the shard.
- While `focus(layout, index)` is in force on a thread, every partitioned
  variable of that layout (a variable and its optimizer slots) stands for its
  shard `index`: reads, writes and shape (see `psclient._coordinator.variables.sharding`,
  which splits an optimizer's update this way).

TF internals used (no public equivalent): `sharded_variable.ShardedVariable`,
`composite_tensor_gradient.CompositeTensorGradient`, `tensor_conversion_registry`.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import tensorflow as tf
from tensorflow.python.distribute import sharded_variable
from tensorflow.python.framework import composite_tensor_gradient, tensor_conversion_registry

from psclient._tf.serving import current_export

__all__ = ["PartitionedVariable", "focus", "is_partitioned"]

_FOCUS = threading.local()  # .value: (layout, shard index) while a split update is traced


@contextlib.contextmanager
def focus(layout: tuple, index: int):
    """Inside, on this thread, partitioned variables of `layout` stand for their shard `index`."""
    _FOCUS.value = (layout, index)
    try:
        yield
    finally:
        _FOCUS.value = None


def _full_gradient(value, grads):
    """The gradient of the whole variable from its shards' gradients."""
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

    @property
    def full_shape(self) -> tf.TensorShape:
        """The whole variable's shape, whatever the focus."""
        return self._shape

    @property
    def layout(self) -> tuple:
        """Full shape and rows per shard: equal for a variable and its slots."""
        return tuple(self._shape.as_list()), tuple(int(v.shape[0]) for v in self.variables)

    @property
    def focused(self):
        """The shard a split update works on now (see `focus`), else None."""
        current = getattr(_FOCUS, "value", None)
        return self.variables[current[1]] if current is not None and current[0] == self.layout else None

    @property
    def shape(self):
        shard = self.focused
        return self._shape if shard is None else shard.shape

    def read_value(self):
        shard = self.focused
        if shard is not None:
            return shard.read_value()
        return tf.concat([shard.read_value() for shard in self.variables], axis=0)

    def value(self):
        return self.read_value()

    def __array__(self, dtype=None, copy=None):
        # What Keras's `Variable.__array__` forwards to (model.save writes weights with it).
        value = self.read_value().numpy()
        return value if dtype is None else value.astype(dtype, copy=False)

    @property
    def shards(self) -> list:
        """The shards' variables, also inside TF's save context (where `variables` is one stand-in)."""
        return list(self._variables)

    def slice_specs(self) -> list[str]:
        """Per shard, its place in the whole variable as a checkpoint slice ("rows dim... start,length:-...")."""
        specs, start, full = [], 0, self._shape.as_list()
        for shard in self._variables:
            rows = int(shard.shape[0])
            offset = [start] + [0] * (len(full) - 1)
            specs.append(tf.Variable.SaveSliceInfo(self.name, full, offset, shard.shape.as_list()).spec)
            start += rows
        return specs

    # Saved under one key as a whole variable (a Keras variable forwards to
    # these): tf.train.Checkpoint(model=...) files hold full values, which a
    # model in another process, partitioned or not, reads back. In a
    # SavedModel (an export in progress) the same key is written as one
    # slice per shard, each read on its ps, so TF's saver writes each slice
    # from the ps that holds it (one data file per task) and no row passes
    # through the coordinator; a reader asking for the whole key (any TF
    # process loading the SavedModel) gets the slices assembled.
    def _serialize_to_tensors(self):
        if current_export() is None:
            return {"VARIABLE_VALUE": self.read_value()}
        slices = {}
        for spec, shard in zip(self.slice_specs(), self._variables):
            with tf.device(shard.device):
                slices[spec] = shard.read_value()
        return {"VARIABLE_VALUE": slices}

    def _restore_from_tensors(self, restored_tensors):
        # The whole value, sliced or not on disk: restores happen outside exports (TF's restore of
        # a trackable's slices hands it one slice only, under the key's one local name).
        value, start, writes = restored_tensors["VARIABLE_VALUE"], 0, []
        for shard in self._variables:
            stop = start + int(shard.shape[0])
            writes.append(shard.assign(value[start:stop], read_value=False))
            start = stop
        return tf.group(*writes)

    @property
    def shard_devices(self) -> list[str]:
        return [shard.device for shard in self.variables]

    @classmethod
    def _overload_operator(cls, operator):
        tensor_operator = getattr(tf.Tensor, operator)

        def _operator(v, *args, **kwargs):
            return tensor_operator(_to_tensor(v), *args, **kwargs)

        setattr(cls, operator, _operator)


def _focused_method(name):
    whole = getattr(sharded_variable.ShardedVariableMixin, name)

    def method(self, *args, **kwargs):
        shard = self.focused
        return whole(self, *args, **kwargs) if shard is None else getattr(shard, name)(*args, **kwargs)

    method.__name__ = name
    return method


for _name in ("assign", "assign_add", "assign_sub", "scatter_add", "scatter_sub", "scatter_update",
              "scatter_max", "scatter_min", "scatter_mul", "scatter_div"):
    setattr(PartitionedVariable, _name, _focused_method(_name))


def _to_tensor(value, dtype=None, name=None, as_ref=False):
    if as_ref:
        # `ops.colocate_with` in a graph asks for a reference op: the
        # first shard's (a slot then starts on the same ps task).
        return value.variables[0].handle
    shard = value.focused
    if shard is not None:
        return tf.convert_to_tensor(shard, dtype=dtype)
    return sharded_variable._var_to_tensor(value, dtype=dtype, name=name)  # noqa: SLF001


# Before ShardedVariable's own (priority 100), which refuses as_ref.
tensor_conversion_registry.register_tensor_conversion_function(PartitionedVariable, _to_tensor, priority=90)
PartitionedVariable._overload_all_operators()  # noqa: SLF001 - TF's own classes call it so


def is_partitioned(variable: Any) -> bool:
    return isinstance(variable, PartitionedVariable)
