"""Variables made before this process connected to a cluster, found again by a dataset's serialization.

Connecting gives this process's CPU a new TF device under the same name
(`local_tables` says why). A variable's handle keeps working for reads and
writes (TF keeps the variable in the handle), but serializing a dataset graph
that uses one (a `map` reading a Keras `SeedGenerator`'s state: the random
augmentation layers of keras.io's image examples applied in the input
pipeline) looks the variable up by its container and name in the *device's*
resource manager, which is the new device's: "Could not find resource:
Anonymous/seed_generator/seed_generator_state/0". Anonymous variables'
names end in a counter that is global to the process, so a variable made
after the connection never has the name of one made before.

`serialize_carrying` serializes again, for each such variable the failure
names, with a copy of it in the new device's resource manager under that
container and name, holding the variable's current value: the serialized
graph then holds that value, as it would have without the connection (every
worker's copy of the dataset starts from it). The copies are destroyed
afterwards; the variables themselves are untouched. Python's garbage collector
lists the live variables, once per serialization that needs it.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import re
from typing import Callable, TypeVar

import tensorflow as tf
from google.protobuf.internal import decoder
from tensorflow.core.framework import resource_handle_pb2, tensor_pb2
from tensorflow.python.eager import context
from tensorflow.python.ops import resource_variable_ops

from psclient._tf.local_tables import subclasses

__all__ = ["MAX_CARRIED", "handle_proto", "missing_variable", "serialize_carrying"]

log = logging.getLogger("psclient")

#: TF's messages for a resource its device's resource manager lacks (ResourceMgr's lookups): the
#: container missing, "Could not find resource: <container>/<name>", or only the name,
#: "Resource <container>/<name>/<type> does not exist".
_MISSING = (re.compile(r"Could not find resource: ([^/\s]+)/(\S+?)\)?(?:\s|$)"),
            re.compile(r"Resource ([^/\s]+)/(\S+)/[^/\s]+ does not exist"))
#: The most variables made before the connection one serialization registers again.
MAX_CARRIED = 64
T = TypeVar("T")


def missing_variable(error: BaseException) -> tuple[str, str] | None:
    """(container, name) of the resource `error` says its device's resource manager lacks, else None."""
    for pattern in _MISSING:
        match = pattern.search(str(error))
        if match is not None:
            return match.group(1), match.group(2)
    return None


def handle_proto(handle) -> resource_handle_pb2.ResourceHandleProto:
    """The ResourceHandleProto of an eager resource tensor (its container, name, device, type).

    TF gives no Python accessor; a serialized resource tensor holds its handles
    varint-length-prefixed in `tensor_content` (TF's EncodeResourceHandleList).
    """
    tensor = tensor_pb2.TensorProto()
    tensor.ParseFromString(tf.io.serialize_tensor(handle).numpy())
    if tensor.resource_handle_val:
        return tensor.resource_handle_val[0]
    size, start = decoder._DecodeVarint(tensor.tensor_content, 0)  # noqa: SLF001 - protobuf's own varint reader
    proto = resource_handle_pb2.ResourceHandleProto()
    proto.ParseFromString(tensor.tensor_content[start:start + size])
    return proto


def _local_variables() -> dict[tuple[str, str], object]:
    """(container, name) -> each live eager variable on this process's own devices."""
    local = context.context().host_address_space()
    kinds = subclasses((resource_variable_ops.BaseResourceVariable,))
    found = {}
    for candidate in [obj for obj in gc.get_objects() if type(obj) in kinds]:  # see local_tables: speed
        handle = getattr(candidate, "_handle", None)
        if handle is None or not hasattr(handle, "numpy") or not handle.device.startswith(local):
            continue  # not made yet, made in a graph (a function's capture), or on a remote task
        proto = handle_proto(handle)
        found[(proto.container, proto.name)] = candidate
    return found


def serialize_carrying(serialize: Callable[[], T], errors: tuple) -> T:
    """`serialize()`; where it fails with one of `errors` naming a variable made before the connection
    (missing from its device's resource manager), again with that variable registered, up to
    `MAX_CARRIED` of them. The last failure is raised as it came."""
    with contextlib.ExitStack() as registrations:
        variables = None
        for _ in range(MAX_CARRIED):
            try:
                return serialize()
            except errors as error:
                missing = missing_variable(error)
                if missing is None:
                    raise
                if variables is None:
                    variables = _local_variables()
                variable = variables.pop(missing, None)
                if variable is None or not registrations.enter_context(_registered(variable, *missing)):
                    raise
        return serialize()


@contextlib.contextmanager
def _registered(variable, container: str, name: str):
    """A copy of `variable` in its device's resource manager as `container`/`name`, while in the block.
    Yields False (and registers nothing) if that resource manager has a variable of that name."""
    with tf.device(variable.device):
        handle = tf.raw_ops.VarHandleOp(dtype=variable.dtype, shape=variable.shape, container=container,
                                        shared_name=name)
        if bool(tf.raw_ops.VarIsInitializedOp(resource=handle)):
            yield False  # it is there: not what was missing
            return
        tf.raw_ops.AssignVariableOp(resource=handle, value=variable.read_value())
    log.info("variable %r (%s/%s), made before the connection, registered again for a dataset's "
             "serialization", variable.name, container, name)
    try:
        yield True
    finally:
        with tf.device(variable.device):
            tf.raw_ops.DestroyResourceOp(resource=handle, ignore_lookup_error=True)
