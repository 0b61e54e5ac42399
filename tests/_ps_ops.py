"""The coordinator's own eager ops on ps devices, listed while a block runs (a test helper).

`eager_ps_ops()` registers a TF op callback (TF's own hook on its eager
execute path, `tensorflow.python.framework.op_callbacks`) on the calling
thread: every op this thread executes eagerly, at trace time too (ops under
`tf.init_scope()`), is seen once it ran, with its inputs' and outputs'
devices. TF keeps op callbacks per thread, so psclient's dispatcher and
recovery threads are not seen: what is listed is what the caller's thread
(fit, evaluate, a callback, `stats()`) asks of the ps tasks itself. Each op
notes whether it ran inside psclient's guarded access
(`psclient._core.ps_access.guarding()`) and the frames of psclient and Keras
that made it. An op that failed is not seen (callbacks run after an op).
"""

from __future__ import annotations

import contextlib
import dataclasses
import traceback

from tensorflow.python.framework import op_callbacks

from psclient._core import ps_access

__all__ = ["PsOp", "eager_ps_ops"]


@dataclasses.dataclass(frozen=True)
class PsOp:
    op: str
    devices: tuple
    guarded: bool
    #: The innermost frames of psclient and Keras that made it, innermost first.
    where: tuple

    def __str__(self) -> str:
        return f"{self.op} on {', '.join(self.devices)} ({'guarded' if self.guarded else 'UNGUARDED'}) <- " + \
            " <- ".join(self.where)


def _where(depth: int = 5) -> tuple:
    frames = [f for f in traceback.extract_stack()[:-2]
              if "/psclient/" in f.filename or "/keras/" in f.filename]
    short = [f"{f.filename.rsplit('/psclient/', 1)[-1].rsplit('/keras/', 1)[-1]}:{f.lineno}:{f.name}"
             for f in frames]
    return tuple(reversed(short[-depth:]))


@contextlib.contextmanager
def eager_ps_ops():
    """Yields a list that fills with a `PsOp` per eager op of this thread on a ps task."""
    found: list[PsOp] = []

    def seen(op_type, inputs, attrs, outputs, op_name=None, graph=None):
        if graph is not None:  # an op added to a graph being traced: it runs elsewhere, later
            return None
        devices = {getattr(t, "device", None) or "" for t in (*(inputs or ()), *(outputs or ()))}
        on_ps = tuple(sorted(d for d in devices if "/job:ps/" in d))
        if on_ps:
            name = op_type.decode() if isinstance(op_type, bytes) else str(op_type)
            found.append(PsOp(name, on_ps, ps_access.guarding(), _where()))
        return None  # outputs unchanged

    op_callbacks.add_op_callback(seen)
    try:
        yield found
    finally:
        op_callbacks.remove_op_callback(seen)
