"""Records Python values that TensorFlow converts to tensors under a task's device.

Converting a Python value (`tf.constant(1)`, the `1` of `x + 1`) while the
current device is a remote task makes TF copy the new tensor to that task
from inside the conversion, holding the GIL: while that task is hung
(SIGSTOPped) every thread of the coordinator stops with it. A tensor made on
the coordinator's CPU and then used by an op placed on the task is copied by
the op, which waits without the GIL.

`RemoteConversions` wraps TF's one eager conversion entry point for the
values it does not already hold as tensors (`constant_op.convert_to_eager_tensor`,
which `tf.constant`, `tf.convert_to_tensor` and the operator overloads reach)
and records each call whose current device names a task of the cluster.
"""

from __future__ import annotations

import threading
import traceback

from tensorflow.python.framework import constant_op

_TASK_JOBS = ("/job:worker", "/job:ps")


class RemoteConversions:
    """Context manager: `found` lists (device, value, stack) of conversions under a task's device
    (a task of `jobs`: "/job:worker", "/job:ps" or both)."""

    def __init__(self, jobs: tuple[str, ...] = _TASK_JOBS):
        self._jobs = jobs
        self.found: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()
        self._original = None

    def __enter__(self):
        original = self._original = constant_op.convert_to_eager_tensor

        def recording(value, ctx, dtype=None):
            device = ctx.device_name or ""
            if any(job in device for job in self._jobs) and not _is_eager_tensor(value):
                # The frames of psclient and the tests: where the value came from.
                stack = "".join(frame for frame in traceback.format_stack()[:-1]
                                if "psclient" in frame or "/tests/" in frame)
                with self._lock:
                    self.found.append((device, repr(value)[:80], stack))
            return original(value, ctx, dtype)

        constant_op.convert_to_eager_tensor = recording
        return self

    def __exit__(self, *exc):
        constant_op.convert_to_eager_tensor = self._original

    def report(self) -> str:
        with self._lock:
            return "\n\n".join(f"{device}: {value}\n{stack}" for device, value, stack in self.found)


def _is_eager_tensor(value) -> bool:
    from tensorflow.python.framework import ops

    return isinstance(value, ops.EagerTensor)
