"""Where TF's default-strategy variable updates run: one patch, one router.

`strategy.extended.update(var, fn)` made outside any tf.distribute strategy
(how Keras 3's and tf_keras's optimizers apply each variable's update under
psclient) ends in `_DefaultDistributionExtended._update_non_slot`, which runs
`fn` with no device: on the caller. `route_default_updates(router)` replaces
it, once per process and class-wide, by a method that hands each update to
`router(colocate_with, fn, args, run)`; `run(args)` is TF's own update with
those arguments, and the router decides under which device, and how many
times, it runs. Without a router, updates run exactly as TF's do.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from tensorflow.python.distribute import distribute_lib

__all__ = ["current_router", "route_default_updates"]

#: `(colocate_with, fn, args, run) -> result`; None: TF's own update.
Router = Callable[[Any, Callable, tuple, Callable[[tuple], Any]], Any]

_lock = threading.Lock()
_router: Router | None = None
_installed = False


def route_default_updates(router: Router | None) -> None:
    """Hand every default-strategy update to `router` from now on (None: TF's own)."""
    global _router, _installed
    with _lock:
        _router = router
        if _installed:
            return
        extended = distribute_lib._DefaultDistributionExtended  # noqa: SLF001
        stock = extended._update_non_slot  # noqa: SLF001

        def _update_non_slot(self, colocate_with, fn, args, kwargs, should_group):
            def run(these_args):
                return stock(self, colocate_with, fn, these_args, kwargs, should_group)

            route = _router
            return run(args) if route is None else route(colocate_with, fn, args, run)

        _update_non_slot.__doc__ = "TF's default-strategy update, routed by psclient (its device, its shards)."
        _update_non_slot.__wrapped__ = stock
        extended._update_non_slot = _update_non_slot  # noqa: SLF001
        _installed = True


def current_router() -> Router | None:
    """The router updates go to now (None: TF's own)."""
    return _router
