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

`split_updates` runs an optimizer's update of a partitioned variable shard by
shard on each shard's ps (see its docstring).

TF internals used here (no public equivalent): `sharded_variable.ShardedVariable`,
`composite_tensor_gradient.CompositeTensorGradient`,
`tensor_conversion_registry`, `distribute_lib._DefaultDistributionExtended._update_non_slot`.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from psclient._core.partitioning import AUTO_MIN_SHARD_BYTES

__all__ = ["create_partitioned", "cut", "is_partitioned", "partitioner_argument", "per_shard", "split_updates"]

_CLASS = None
_FOCUS = threading.local()  # .value: (layout, shard index) while a split update is traced


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

        @property
        def layout(self) -> tuple:
            """Full shape and rows per shard: equal for a variable and its slots."""
            return tuple(self._shape.as_list()), tuple(int(v.shape[0]) for v in self.variables)

        @property
        def focused(self):
            """The shard a split update works on now (see `split_updates`), else None."""
            focus = getattr(_FOCUS, "value", None)
            return self.variables[focus[1]] if focus is not None and focus[0] == self.layout else None

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

        # Saved whole, as one variable (a Keras variable forwards to these):
        # tf.train.Checkpoint(model=...) files hold full values, which a
        # model in another process, partitioned or not, reads back.
        def _serialize_to_tensors(self):
            return {"VARIABLE_VALUE": self.read_value()}

        def _restore_from_tensors(self, restored_tensors):
            value, start, writes = restored_tensors["VARIABLE_VALUE"], 0, []
            for shard in self.variables:
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
    PartitionedVariable._overload_all_operators()
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


def create_partitioned(next_creator: Callable, kwargs: dict, parts: list, devices: list[str]):
    """Create shard `i` on `devices[i]` with initial value `parts[i]`; wrap them.

    `kwargs` are the `tf.Variable` arguments the creator received. A part is
    a tensor (see `cut`) or a zero-argument callable, which `tf.Variable`
    runs under the shard's device: its value is made on that shard's ps.
    """
    import tensorflow as tf

    cls = _class()
    name = kwargs.get("name") or "Variable"
    shards = []
    for index, (part, device) in enumerate(zip(parts, devices)):
        shard_kwargs = dict(kwargs, initial_value=part, name=f"{name}/part_{index}")
        shard_kwargs.pop("shape", None)
        with tf.device(device):
            shards.append(next_creator(**shard_kwargs))
    return cls(shards, name=name)


def cut(value, ranges: list[tuple[int, int]]) -> list:
    """`value`'s rows of each range, sliced where `value` is."""
    import tensorflow as tf

    if tf.is_symbolic_tensor(value):
        # A value computed inside a trace (an optimizer built by its first
        # step): cut it there; TF lifts each shard's initializer as it would
        # the whole one.
        return [value[start:stop] for start, stop in ranges]
    # An eager value: cut eagerly, on its own device (a value already on a
    # ps stays there; only the shards travel, ps to ps).
    with tf.init_scope(), tf.device(value.device or None):
        return [value[start:stop] for start, stop in ranges]


# Keras optimizers whose update is elementwise in the variable, its slots and
# its gradient, so applying it to each shard's rows gives the update of the
# whole (not Adafactor: its factored slots average over rows and columns;
# psclient._keras.adafactor splits its update with sums from every shard).
_ELEMENTWISE_OPTIMIZERS = frozenset(
    {"SGD", "Adam", "AdamW", "Adamax", "Adagrad", "RMSprop", "Lion", "Ftrl", "Adadelta", "Nadam"}
)
_split_installed = False
_split_lock = threading.Lock()


def split_updates() -> None:
    """Run an optimizer's update of a partitioned variable shard by shard, each on its ps.

    Keras applies each variable's update as `extended.update(var, fn)`, which
    ends in TF's default strategy's `_update_non_slot` (TF-internal). For a
    Keras variable whose value is a `PartitionedVariable` and an optimizer in
    `_ELEMENTWISE_OPTIMIZERS`, `fn` is traced once per shard, under that
    shard's ps device, with the gradient's rows of that shard (sliced on the
    worker: only they travel) and every partitioned variable of the same
    layout (the variable and its slots) standing for its shard while `fn`
    runs. So the arithmetic, the slot reads and the writes happen on each
    shard's ps. Any other update runs as before (the whole variable, on the
    worker). Installed once per process; inert without partitioned variables.
    """
    global _split_installed
    with _split_lock:
        if _split_installed:
            return
        import tensorflow as tf
        from tensorflow.python.distribute import distribute_lib

        extended = distribute_lib._DefaultDistributionExtended  # noqa: SLF001
        inner = extended._update_non_slot  # noqa: SLF001

        def _update_non_slot(self, colocate_with, fn, args, kwargs, should_group):
            value = colocate_with if is_partitioned(colocate_with) else getattr(colocate_with, "value", None)
            if not is_partitioned(value) or value.focused is not None or not _elementwise(fn):
                return inner(self, colocate_with, fn, args, kwargs, should_group)
            results, start = [], 0
            for index, shard in enumerate(value.variables):
                stop = start + int(shard.shape[0])
                shard_args = tuple(_rows(arg, start, stop, value) for arg in args)  # on the worker
                _FOCUS.value = (value.layout, index)
                try:
                    with tf.device(shard.device):
                        results.append(inner(self, colocate_with, fn, shard_args, kwargs, should_group))
                finally:
                    _FOCUS.value = None
                start = stop
            return tuple(results)

        _update_non_slot.__doc__ = "TF's default-strategy update, shard by shard for a partitioned variable (psclient)."
        _update_non_slot.__wrapped__ = inner
        extended._update_non_slot = _update_non_slot  # noqa: SLF001
        _split_installed = True


def _elementwise(fn) -> bool:
    """Whether `fn` is the update of an optimizer known to be elementwise.

    Keras's update function is a closure over its optimizer (TF's autograph
    may wrap it in a closure of its own, hence the search a few levels
    deep); one not found there (another caller of `extended.update`) is not
    split.
    """
    functions, seen = [fn], set()
    for _depth in range(3):
        inner = []
        for function in functions:
            if id(function) in seen:
                continue
            seen.add(id(function))
            for cell in getattr(function, "__closure__", None) or ():
                try:
                    owner = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                if hasattr(owner, "update_step") and hasattr(owner, "iterations"):
                    return type(owner).__name__ in _ELEMENTWISE_OPTIMIZERS
                if callable(owner) and hasattr(owner, "__closure__"):
                    inner.append(owner)
        functions = inner
    return False


def _rows(arg, start: int, stop: int, value):
    """`arg`'s rows start:stop if it is a gradient of `value`'s full shape, else `arg`."""
    import tensorflow as tf

    full = value._shape  # noqa: SLF001 - the full shape (`shape` follows the focus)
    if isinstance(arg, tf.IndexedSlices):
        rows = tf.logical_and(arg.indices >= start, arg.indices < stop)
        return tf.IndexedSlices(
            tf.boolean_mask(arg.values, rows),
            tf.boolean_mask(arg.indices, rows) - tf.cast(start, arg.indices.dtype),
            tf.constant([stop - start] + full.as_list()[1:], dtype=tf.int64),
        )
    if isinstance(arg, (tf.Tensor, tf.Variable)) and arg.shape == full:
        return arg[start:stop]
    return arg


def per_shard(grad, variable) -> list:
    """`grad`, a gradient of the whole partitioned `variable`, cut into its shards' rows."""
    pieces, start = [], 0
    for shard in variable.variables:
        stop = start + int(shard.shape[0])
        pieces.append(_rows(grad, start, stop, variable))
        start = stop
    return pieces


def partitioner_argument(variable_partitioner: Any, num_ps: int) -> Callable | None:
    """`ParameterServerStrategy(variable_partitioner=...)` checked, "auto" made concrete.

    "auto" is the default: TF's MinSizePartitioner, 128 KiB per shard at
    least, one shard per ps at most (None with a single ps task: nothing to
    split over).
    """
    if isinstance(variable_partitioner, str) and variable_partitioner != "auto":
        raise ValueError(
            "Invalid value for argument `variable_partitioner`. Received: "
            f"variable_partitioner={variable_partitioner!r}. Expected \"auto\" (the default), "
            "None (no partitioning) or a callable (shape, dtype) -> shards per axis."
        )
    if not (variable_partitioner is None or isinstance(variable_partitioner, str) or callable(variable_partitioner)):
        raise TypeError(
            "Invalid value for argument `variable_partitioner`. Received: "
            f"variable_partitioner={variable_partitioner!r} of type "
            f"{type(variable_partitioner).__name__}. Expected \"auto\" (the default), None (no "
            "partitioning) or a callable (shape, dtype) -> shards per axis, e.g. "
            "tf.distribute.experimental.partitioners.MinSizePartitioner(...)."
        )
    if variable_partitioner != "auto":
        return variable_partitioner
    if num_ps == 1:
        return None  # one task: a split would only add ops
    import tensorflow as tf

    return tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=AUTO_MIN_SHARD_BYTES, max_shards=num_ps)
