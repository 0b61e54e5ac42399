"""Initial values made on the ps task that will hold them, never in the coordinator.

A variable created in `strategy.scope()` with a callable initial value (every
Keras 3 weight and optimizer slot, `tf.Variable(fn, shape=..., dtype=...)`,
tf_keras's weights) gets its value from that callable run under
`tf.device(<its ps>)`: the ops that make it run on the ps and the value never
exists in the coordinator's memory. Placement needs only the shape and dtype,
which are known before the value is made:

- a Keras 3 variable describes itself (`InitSpec`) through `describing()`,
  entered by psclient's Keras seam around Keras's own initialisation; the
  store takes the description with `take_pending()`;
- a plain callable comes with `shape=` and `dtype=` (tf_keras passes both),
  or, without them, is run on the least-loaded ps first and placed there.

A partitioned variable is made shard by shard, each on its shard's ps, by
`shard_values`, in the first way that applies:

1. the initializer is elementwise and i.i.d. (`InitSpec.shard`, given by the
   Keras seam for Zeros, Ones, Constant, the random and variance-scaling
   initializers) and the variable has `SHARD_BY_SHARD_BYTES` or more: each
   shard drawn from its own shape with the statistics of the full shape
   (fans of the full shape);
2. TF's protocol for partitioned initial values (what TF's
   ParameterServerStrategy tries, and tf_keras's initializers answer):
   `fn(partition_shape=..., partition_offset=...)` returns the shard;
3. otherwise (Orthogonal, Identity, a user's function, an elementwise
   initializer of a variable under `SHARD_BY_SHARD_BYTES`) the full value is made
   once on the first shard's ps and each shard sliced from it there; it costs
   that ps the full value's size for as long as the shards are being made,
   and the coordinator nothing. Shards are copied ps to ps.

An initial value that is already a tensor (a numpy array, an eager tensor)
exists in the coordinator before psclient sees it: nothing to save there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from typing import Any, Callable

import tensorflow as tf

from psclient._tf import variables as _variables

__all__ = ["SHARD_BY_SHARD_BYTES", "InitSpec", "describing", "is_checkpoint_value", "known_shape", "shard_values", "take_pending"]

_PENDING = threading.local()

#: Below this size a partitioned variable with an elementwise initializer is
#: still drawn whole on its first shard's ps and sliced: its values are then
#: exactly Keras's for the same seed, whatever the partitioning (as in a model
#: built in one process), for at most this many bytes once on one ps. From
#: this size on, shard by shard: nothing of the size of the whole variable
#: is made anywhere.
SHARD_BY_SHARD_BYTES = 16 << 20


@dataclasses.dataclass(frozen=True)
class InitSpec:
    """What a variable about to be created will hold, before its value exists.

    `shard(shape, index)` gives shard `index` (of `shape`, rows of the full
    variable) with the full variable's statistics; None when the initializer
    is not elementwise (then the full value is made and sliced on a ps).
    """

    shape: tuple
    dtype: Any
    shard: Callable[[tuple, int], Any] | None = None


@contextlib.contextmanager
def describing(spec: InitSpec):
    """The next variable this thread creates in scope() is described by `spec`.

    The strategy's variable creator takes it (`take_pending`); cleared on
    exit, so a variable made outside any psclient scope leaves nothing behind.
    """
    previous = getattr(_PENDING, "spec", None)
    _PENDING.spec = spec
    try:
        yield
    finally:
        _PENDING.spec = previous


def take_pending() -> InitSpec | None:
    """The description of the variable being created, once (nested creations see None)."""
    spec = getattr(_PENDING, "spec", None)
    _PENDING.spec = None
    return spec


def is_checkpoint_value(initial_value: Any) -> bool:
    """Whether `initial_value` restores from a checkpoint file (TF's deferred restore).

    Those read a file the coordinator can see and a ps may not: they keep
    running on the coordinator.
    """
    return _variables.is_checkpoint_initial_value(initial_value)


def known_shape(kwargs: dict, spec: InitSpec | None) -> tuple[tuple | None, Any]:
    """(shape, dtype) of the variable `kwargs` will create, when known without its value."""
    if spec is not None:
        return tuple(spec.shape), tf.as_dtype(spec.dtype)
    shape, dtype = kwargs.get("shape"), kwargs.get("dtype")
    if shape is None or dtype is None:
        return None, None
    shape = tf.TensorShape(shape)
    if not shape.is_fully_defined():
        return None, None
    return tuple(shape.as_list()), tf.as_dtype(dtype)


def shard_values(fn: Callable, spec: InitSpec | None, shape: tuple, ranges: list[tuple[int, int]],
                 devices: list[str]) -> tuple[list[Callable], Callable[[], None]]:
    """One zero-argument callable per shard, each run by the creator under its shard's device, and a release.

    Shards are created in order, so the first decides whether `fn` takes TF's
    protocol (see the module docstring for the three ways). The release drops
    the full value kept on the first shard's ps by the third way, once every
    shard exists.
    """
    shard_shapes = [(stop - start,) + tuple(shape[1:]) for start, stop in ranges]
    nbytes = tf.as_dtype(spec.dtype).size * math.prod(shape) if spec is not None else 0
    if spec is not None and spec.shard is not None and nbytes >= SHARD_BY_SHARD_BYTES:
        return [_bound(spec.shard, s, i) for i, s in enumerate(shard_shapes)], _nothing
    whole = _Whole(fn, devices[0])
    # A Keras initializer (described by `spec`) takes (shape, dtype) only.
    protocol = {"on": spec is None}

    def shard(index: int) -> Callable:
        start, stop = ranges[index]
        offset = (start,) + (0,) * (len(shape) - 1)

        def value():
            if protocol["on"]:
                try:
                    part = tf.convert_to_tensor(fn(partition_shape=shard_shapes[index], partition_offset=offset))
                except (TypeError, ValueError):  # as TF's strategy: `fn` does not take the protocol
                    protocol["on"] = False
                else:
                    if tuple(part.shape.as_list()) == shard_shapes[index]:
                        return part
                    protocol["on"] = False
                    if index == 0 and tuple(part.shape.as_list()) == tuple(shape):
                        whole.offer(part)  # `fn` ignored the protocol: this is the whole, on the first ps
            with tf.device(devices[0]):  # sliced where the whole value is
                return whole.get()[start:stop]
        return value

    return [shard(i) for i in range(len(ranges))], whole.release


def _nothing() -> None:
    return None


def _bound(function: Callable, *args) -> Callable:
    def value():
        return function(*args)
    return value


class _Whole:
    """The full initial value, made once on `device` when first needed."""

    def __init__(self, fn: Callable, device: str):
        self._fn, self._device, self._value = fn, device, None

    def get(self):
        if self._value is None:
            with tf.device(self._device):
                self._value = tf.convert_to_tensor(self._fn())
        return self._value

    def offer(self, value) -> None:
        self._value = value

    def release(self) -> None:
        self._value = None
