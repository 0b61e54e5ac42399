"""Writes of psclient's Keras callbacks (`ServingExport`, `ModelCheckpoint`, `BackupAndRestore`) from
`fit`, through ps faults: training goes on.

A write from `fit`'s hooks runs through a ps loss (`psclient._coordinator.ps_state.on_ps`: a ps lost
is restored by the strategy first, then the write is made again). A write given up on a ps that
hung (no answer within `hang_timeout`: a `PSUnavailableError` or `CheckpointWriteError` caused by a
`PsTimeout`; nothing was published, the previous checkpoint or version stays the newest) is noted
(`failures`, a warning) and left `pending`: the callback makes it again at its first hook after the
ps answered (the steps wait for it meanwhile). The given-up try goes on waiting on that ps in a
thread of its own (`checkpoint_parts.waiting_on`: a TF call cannot be cancelled); the first hook after
the give-up gives that thread `ANSWER_GRACE` seconds to end (the steps before that hook waited for
the ps, so it has usually just answered), later hooks only look; while it still waits, a hook does
not try again, which would wait `hang_timeout` more and leave one more thread waiting on the same
ps at every hook. So a ps that goes on hanging while steps that do not touch it run costs one
grace per given-up write, not one per batch. A write
that ends `fit` is tried `FINAL_ATTEMPTS` times, whether or not the ps has answered. Any other
error (a ps the strategy could not restore, a full disk, a bug) is raised, as before.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from psclient._coordinator.checkpoints.checkpoint_parts import CheckpointWriteError, PsTimeout, waiting_on
from psclient._coordinator.ps_state import on_ps
from psclient._core.errors import PSUnavailableError, hung_ps_of
from psclient._engine import registry

__all__ = ["ANSWER_GRACE", "FINAL_ATTEMPTS", "HungPsWrites", "given_up_on_a_hung_ps", "writes_of"]

#: Attempts of a write that ends `fit` (what training ended with) while a ps hangs.
FINAL_ATTEMPTS = 3
#: Seconds the first hook after a give-up gives the given-up try to end before it passes without
#: trying: a ps that has just answered ends it within this (so the write is made again at that
#: hook), one that still hangs costs that hook this much, not another `hang_timeout`.
ANSWER_GRACE = 1.0

_log = logging.getLogger(__name__)


def given_up_on_a_hung_ps(error: BaseException) -> bool:
    """Whether `error` is a write given up because a ps did not answer within `hang_timeout`."""
    return isinstance(error, (PSUnavailableError, CheckpointWriteError)) and isinstance(error.__cause__, PsTimeout)


class HungPsWrites:
    """One callback's writes from `fit` (module doc). `what` names them in errors and warnings."""

    def __init__(self, what: str):
        self.what = what
        #: One dict per write given up on a hung ps: {"task", "error", "at": time.time()}.
        self.failures: list[dict] = []
        #: Whether the last write was given up: the callback makes it again at a later hook.
        self.pending = False
        #: Hooks that passed while the given-up try still waited on its ps (no try made at them).
        self.hooks_waited = 0
        self._hung_ps: int | None = None  # the ps the last given-up write waited on, when known
        self._graced = False  # whether a hook already gave the last given-up try its grace

    def still_waiting(self) -> bool:
        """Whether the last given-up write's try still waits on its ps (that ps has not answered);
        waits up to `ANSWER_GRACE` for it at the first call after the give-up only."""
        if not self.pending or self._hung_ps is None:
            return False
        grace, self._graced = (0.0 if self._graced else ANSWER_GRACE), True
        return waiting_on(self._hung_ps, grace=grace)

    def run(self, write: Callable[[], Any], final: bool = False) -> None:
        if not final and self.still_waiting():
            self.hooks_waited += 1
            return  # tried again at the first hook after the ps answered (module doc)
        for attempt in range(FINAL_ATTEMPTS if final else 1):
            try:
                on_ps(registry.current(), write, self.what)
            except (PSUnavailableError, CheckpointWriteError) as error:
                if not given_up_on_a_hung_ps(error) or (final and attempt + 1 == FINAL_ATTEMPTS):
                    raise
                self.pending = True
                ps = self._hung_ps = hung_ps_of(error)
                self._graced = False
                self.failures.append({"task": getattr(error, "task", None) or (None if ps is None else f"ps:{ps}"),
                                      "error": f"{type(error).__name__}: {error}", "at": time.time()})
                _log.warning("%s was given up (%s); nothing was published, it is made again %s", self.what,
                             str(error).splitlines()[0],
                             "now" if final else "at the callback's first hook after the ps answers")
                continue
            self.pending, self._hung_ps = False, None
            return


def writes_of(callback, what: str) -> HungPsWrites:
    """`callback`'s `HungPsWrites`, made at the first call (kept in its `__dict__` under a key of
    psclient's own: no attribute name to collide with Keras's)."""
    writes = callback.__dict__.get(_KEY)
    if writes is None:
        writes = callback.__dict__[_KEY] = HungPsWrites(what)
    return writes


_KEY = "psclient_hung_ps_writes"
