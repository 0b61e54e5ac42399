"""The copy before a checkpoint's cut, on a thread of its own.

A strategy checkpoint first copies its big sparse-updated variables and table shards on
their ps while training goes on (`psclient._coordinator.checkpoints.fuzzy_copy`); that
takes time in proportion to them (about 1.2 s for 1 GB a ps here). Run on the recovery
thread, it held every failure seen meanwhile until it ended: a worker that hung during it
kept its closures until then (its heartbeat runs on that thread), and a ps lost during it
was recovered only after. So the
recovery machine starts it (`CopyForCheckpoint`) and goes on handling events; the copy
reports its end as `CheckpointCopied`, and only then does dispatch pause for the cut.
A ps recovery stops it (`StopCopy`) before it renews the variables the copy reads. A ps that
does not answer the copy within `hang_timeout` fails the checkpoint at once (`CheckpointWriteError`
naming it, in `CheckpointCopied`): a cut would pause dispatch and wait on it as long again.

`CopyThread` owns the thread: `stop` sets its flag (the copy checks it between chunks)
and joins it; the recovery's `stop` calls it at shutdown. The copies reach the checkpoint
only through `take`, at the pause: a copy stopped (or still running when its stop gave up
waiting, on a hung ps) is never used, though its thread ends later.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from psclient._core import ps_access, recovery_messages as rm
from psclient._core.errors import PSClientError

__all__ = ["CopyThread"]

log = logging.getLogger("psclient")

# The previous copy's thread ends at once (it reported its end, or was stopped and stops waiting
# within half a second): a bound, not a wait expected to run out.
_JOIN_S = 60.0


class CopyThread:
    """Runs `copy(stop)` for each `start(number)` on a thread of its own, keeps what it returns
    for `take`, then posts `CheckpointCopied(number)` with `report`; at most one at a time."""

    def __init__(self, copy: Callable[[Callable[[], bool]], Any], report: Callable[[Any], None]):
        self._copy = copy
        self._report = report
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()  # `_copied` against a stop
        self._copied: Any = None

    def start(self, number: int) -> None:
        self.stop(_JOIN_S)  # the previous copy has ended (the machine waits for it): joined here
        stop = self._stop = threading.Event()

        def run() -> None:
            gave_up = None
            try:
                with ps_access.handled_elsewhere():  # a ps error ends the copy; the machine decides
                    copied = self._copy(stop.is_set)
                with self._lock:
                    if not stop.is_set():
                        self._copied = copied
            except PSClientError as error:  # a ps that did not answer (CheckpointWriteError): the checkpoint fails
                gave_up = error
                log.warning("checkpoint given up before its cut: %s", error)
            finally:
                self._report(rm.CheckpointCopied(number, gave_up))

        self._thread = threading.Thread(target=run, name="psclient-checkpoint-copy", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> bool:
        """Ask the copy under way to end at its next chunk and wait for its thread (at most
        `timeout` s; it stops waiting on a hung ps within half a second); False if it still
        runs then. What it copied is dropped."""
        with self._lock:
            self._stop.set()
            self._copied = None
        thread, self._thread = self._thread, None
        if thread is None:
            return True
        thread.join(timeout)
        if thread.is_alive():
            log.warning("the copy before a checkpoint's cut did not end within %s s of being stopped", timeout)
            self._thread = thread
            return False
        return True

    def take(self) -> Any:
        """What the last copy made (None: nothing, or stopped), once: for the cut."""
        with self._lock:
            copied, self._copied = self._copied, None
        return copied

