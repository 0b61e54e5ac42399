"""tf.functions that captured a variable whose ps was lost: traced again at their next call.

A recovered ps gets its variables back under new resource handles (`variables.renew_handle`:
the Python objects stay, the handles are new). A trace captures a variable's handle by value, so
every trace made before holds a handle to a resource that went with the old ps task, and running
it fails on the task ("Unable to find the relevant tensor remote_handle"). psclient traces the
functions given to `schedule` again from their Python code after a recovery, but a `tf.function`
that such a function calls (a nested one: a train step called from a loop of steps, a helper
shared by two steps) kept its own traces, and the new trace of the outer one inlined the old
inner one: every step failed after the recovery, under `"part"` and `"all"` alike.

So once a handle has been renewed, TF's `Function.__call__` (the one method of TF's function
class psclient replaces; bound to the TF versions `pyproject.toml` allows) first asks whether the
function's traces captured a renewed handle, once per function and renewal: if so, it calls a new
`tf.function` of the same Python code and options instead (`functions.fresh_tf_function`), which
traces with the handles of now; if not, the function itself, as before. Until a first renewal
nothing is replaced, so a process that never loses a ps runs TF's code unchanged.

Not traced again: a function whose first trace created variables (TF allows a `tf.Variable`
created inside a tf.function on its first trace only; a new trace would create another one, with
none of the first one's state). Such a function that also captured a renewed handle fails as
before; make its variables outside it.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any

import tensorflow as tf

from psclient._tf.functions import fresh_tf_function

__all__ = ["handle_renewed", "renewals"]

_lock = threading.Lock()  # the renewals' bookkeeping only
# id -> a renewed (dead) handle, while some trace still holds it: a dead handle kept alive only here
# would make nothing stale, and an id is only trusted together with the object it names.
_dead: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_epoch = 0  # renewals so far: a function's verdict is kept until the next one


def renewals() -> int:
    """How many handles this process has renewed (0: TF's function calls run unchanged)."""
    return _epoch


def handle_renewed(old_handle: Any) -> None:
    """`old_handle` (an eager resource handle) names a resource gone with its ps task."""
    global _epoch
    with _lock:
        _dead[id(old_handle)] = old_handle
        _epoch += 1
        _hook_function_calls()


def _hook_function_calls() -> None:
    function_class = type(tf.function(lambda: None))
    call = function_class.__call__
    if getattr(call, "_psclient_original", None) is not None:
        return

    @functools.wraps(call)
    def __call__(self, *args, **kwargs):
        return call(_current(self), *args, **kwargs)

    __call__._psclient_original = call  # noqa: SLF001 - ours: marks the hook installed
    function_class.__call__ = __call__


def _current(function: Any) -> Any:
    """What a call of `function` runs: itself, or its new trace made after the latest renewal.

    No lock: two threads that decide at once may each make a new function, both right (the
    last one kept). The check traces nothing and waits on nothing, so it cannot deadlock with a
    trace under way on another thread."""
    epoch = _epoch
    state = function.__dict__.get("_psclient_current")  # (epoch, the new function, or None: itself)
    if state is not None and state[0] == epoch:
        return function if state[1] is None else state[1]
    target = function if state is None or state[1] is None else state[1]
    if _holds_dead_handle(target) and not _created_variables(target):
        target = fresh_tf_function(target)
    # None for itself: a function must not hold itself (a cycle frees it only at a collection).
    function._psclient_current = (epoch, None if target is function else target)  # noqa: SLF001
    return target


def _traces(function: Any) -> list:
    cache = getattr(function, "_function_cache", None)  # TF's cache of traces; traced nothing
    if cache is not None:
        return cache.values()
    return function._list_all_concrete_functions()  # noqa: SLF001 - TF has no public list of traces


def _captured(concrete: Any) -> list:
    """A trace's captured values, without calling its deferred captures (`captured_inputs` would:
    a callable is evaluated at each call, so it holds no handle of its own)."""
    captured = getattr(concrete, "_captured_inputs", None)
    if captured is None:
        return concrete.captured_inputs
    return [value for value in captured if not callable(value)]


def _holds_dead_handle(function: Any) -> bool:
    for concrete in _traces(function):
        for captured in _captured(concrete):
            if _dead.get(id(captured)) is captured:
                return True
    return False


def _created_variables(function: Any) -> bool:
    created = getattr(function, "_created_variables", None)  # TF's weak references to them, or None
    return bool(created)
