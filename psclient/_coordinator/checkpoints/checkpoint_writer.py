"""Checkpoints written while training goes on: one background write at a time.

A strategy checkpoint is taken in two steps (`checkpoint.Checkpoints`):

1. in a cut (dispatch paused, no closure running), each ps takes a snapshot
   of what it holds (`checkpoint_parts.take_snapshot`): handles of tensors
   on that ps, nothing copied to the coordinator;
2. dispatch resumes, and this module's thread has each ps write its
   snapshot (SaveV2 there), merges the parts and commits the state file
   last, as a save always did.

`BackgroundWriter` owns that thread. One write is in flight at a time
(`submit` refuses a second: the recovery machine holds the next checkpoint
until the first's write ended). Its outcome goes to `on_done(pending, path,
error)`; an error nobody waited for is logged there, counted, and kept
(`unobserved_error`) until a later write succeeds or a caller takes it.
`close()` joins the thread.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Callable

__all__ = ["BackgroundWriter", "PendingSave"]

log = logging.getLogger("psclient")


@dataclasses.dataclass
class PendingSave:
    """A checkpoint taken in a cut, to be written: its snapshot and what goes beside it."""

    snapshot: Any  # checkpoint_parts.Snapshot
    completed: int | None
    scalars: dict
    meta: dict | None
    #: Asked to be written as a delta (`checkpoint_deltas`), and the row-diffed shards then.
    delta: bool = False
    rows: dict | None = None
    #: Each dynamic table's `renewals` then: a renewed shard's kept export died with its ps.
    renewals: dict | None = None
    #: Filled in when written (or failed).
    path: str | None = None


class BackgroundWriter:
    """The thread that writes snapshots; see the module docstring.

    `write(pending) -> path` does the writing (on this thread); `on_done(pending,
    path, error)` hears each outcome, on this thread, after the counters changed.
    """

    def __init__(self, write: Callable[[PendingSave], str]):
        self._write = write
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        #: Counters for stats(): writes ended, their errors, the last write's seconds.
        self.writes = 0
        self.write_errors = 0
        self.last_write_seconds: float | None = None
        self.last_error: str | None = None

    @property
    def writing(self) -> bool:
        with self._lock:
            return self._thread is not None

    def submit(self, pending: PendingSave, on_done: Callable[[PendingSave, str | None, BaseException | None], None]
               ) -> None:
        """Start writing `pending`; raises RuntimeError if a write is in flight or the writer is closed."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the checkpoint writer is closed: no checkpoint is written after shutdown")
            if self._thread is not None:
                raise RuntimeError("a checkpoint is being written already: one write at a time")
            self._thread = threading.Thread(target=self._run, args=(pending, on_done),
                                            name="psclient-ckpt-writer", daemon=True)
            self._thread.start()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Until no write is in flight; False if one still is after `timeout` seconds."""
        with self._lock:
            return self._lock.wait_for(lambda: self._thread is None, timeout)

    def close(self, timeout: float | None = None) -> bool:
        """No write after this; waits for the one in flight. False if it still runs after `timeout`."""
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True

    def _run(self, pending: PendingSave, on_done: Callable) -> None:
        started = time.monotonic()
        path, error = None, None
        try:
            path = self._write(pending)
        except Exception as caught:  # noqa: BLE001 - handed on to on_done: the recovery machine decides
            error = caught
        seconds = time.monotonic() - started
        with self._lock:
            self.writes += 1
            self.last_write_seconds = seconds
            if error is not None:
                self.write_errors += 1
                self.last_error = f"{type(error).__name__}: {error}"
        try:
            on_done(pending, path, error)
        finally:
            with self._lock:
                self._thread = None
                self._lock.notify_all()
