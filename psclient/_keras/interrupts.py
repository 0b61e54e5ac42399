"""A Ctrl-C during `fit` on the cluster stops it, even when Python dropped its KeyboardInterrupt.

Python raises a signal's exception wherever the main thread happens to be. Raised inside a
destructor or a weakref callback (TF deletes remote tensors, resources and traces in them, many a
step on a cluster), it is printed as "Exception ignored" and dropped, and training goes on as if
no key was pressed: 1 of 18 interrupted `psclient demo` runs on a loaded machine trained on until
their 60 s deadline (docs/cli.md, `benchmarks/demo_interrupt.py`; the demo has a handler of its
own, so it re-raises through a callback of its own).

So while `fit` runs on the main thread with Python's own SIGINT handler in place, psclient puts
one in its place that also remembers the interrupt, and fit's callback list raises it again
after each step and epoch (`trainer.fit_callbacks`) until it leaves `fit`. Python's handler is
put back when `fit` ends. A process with its own SIGINT handler (a server, `psclient demo`, a
notebook kernel's) keeps it: nothing is replaced then.
"""

from __future__ import annotations

import signal
import threading

__all__ = ["InterruptWatch"]


class InterruptWatch:
    """A context manager around one `fit` (see the module's docstring)."""

    def __init__(self):
        self.interrupted = False
        self._installed = False

    def __enter__(self) -> InterruptWatch:
        if threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, self._handler)
            self._installed = True
        return self

    def __exit__(self, *exc_info) -> None:
        # Put back only what was replaced, and only if nobody replaced it meanwhile.
        if self._installed and signal.getsignal(signal.SIGINT) == self._handler:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        self._installed = False

    def _handler(self, signum, frame):
        self.interrupted = True
        signal.default_int_handler(signum, frame)  # raises KeyboardInterrupt, as Python's own does

    def raise_if_interrupted(self) -> None:
        """Raise KeyboardInterrupt if a Ctrl-C came during this `fit` (its first raise may have been
        dropped; if it was not, `fit` is already unwinding and this is not called again)."""
        if self.interrupted:
            raise KeyboardInterrupt
