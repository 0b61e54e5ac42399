"""`export_servable` on a cluster: a hung ps makes it give up after `hang_timeout`, naming the ps.

Keras's export traces the serving endpoints, then TF's saver has each ps
write its part of the SavedModel's variables: TF calls that cannot be
cancelled nor given a deadline, which a SIGSTOPped ps would hold forever.
So the export runs on a thread of its own (`THREAD_NAME`), its traces
registering their functions through the streaming executor
(`streamed_function_registrations`: a registration waiting on a hung ps
would hold the GIL, and the caller with it; its eager ops go unary through
an executor of the thread's own, so that a ps that died fails them, and
neither a reconnect nor other threads' errors meet them on TF's default
executor), and the calling thread

- first has every ps answer a tiny op within `hang_timeout`, through the
  checkpoints' bounded per-ps helper (`checkpoint_parts.on_each_ps`): an
  export never begins with a ps already hung, and nothing is written then;
- then, until the export ends, has every ps answer again every
  `PROBE_EVERY_S` seconds (each probe bounded the same way).

A ps that does not answer in time: the export is abandoned and
`PSUnavailableError` names the ps. Its thread goes on until that ps answers
or dies, and its version is never published: the hidden directory it writes
in is removed instead of renamed (`Publication`), once the thread ends. A ps
that answers a probe with an error (gone, not hung) is left to fail the
export's own calls: it ends with their error, as it would without probes. The next export waits for an abandoned one to end (one
export at a time per process).

An export that fails with TF's error (a killed ps fails its calls at once:
"Connection reset by peer", "failed to connect") has every ps probed once
more, all at once within `hang_timeout`: one that fails its probe is named
in a `PSUnavailableError` chained to TF's error, as the hung case names it; if
every ps answers (one already restarted), TF's error is raised as it is.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import tensorflow as tf

from psclient._coordinator import runtime as _runtime
from psclient._coordinator.checkpoints.checkpoint_parts import PsTimeout, on_each_ps
from psclient._core.errors import PSUnavailableError, first_line
from psclient._tf.executors import on_thread_executor, streamed_function_registrations

__all__ = ["Abandoned", "Publication", "THREAD_NAME", "export_bounded", "wait_bounded"]

#: How often every ps is probed while an export runs (seconds; each probe waits `hang_timeout` at most).
PROBE_EVERY_S = 1.0
#: The name of an export's thread: one alive after `export_bounded` raised waits on a hung ps.
THREAD_NAME = "psclient-export"


class Abandoned(Exception):
    """Raised inside an export's version block when its caller gave up on it: the version is not published."""


class Publication:
    """Whether an export's version may still be published, decided once under a lock: by the export
    (`may_publish`, before the rename) or by its caller giving up (`abandon`), whichever comes first."""

    def __init__(self):
        self._lock = threading.Lock()
        self._state = "writing"

    def may_publish(self) -> bool:
        with self._lock:
            if self._state == "abandoned":
                return False
            self._state = "publishing"
            return True

    def abandon(self) -> bool:
        """False: too late, the version is being published (a local rename: wait for it)."""
        with self._lock:
            if self._state == "publishing":
                return False
            self._state = "abandoned"
            return True


def export_bounded(write: Callable[[Publication], Any], num_ps: int, hang_timeout: float,
                   describe_ps: Callable[[int], str], what: str = "export_servable") -> Any:
    """`write(publication)` on the export thread, every ps probed meanwhile; its result.

    `write` must raise `Abandoned` instead of publishing when
    `publication.may_publish()` is False. Raises PSUnavailableError naming a
    ps that did not answer within `hang_timeout`; `write`'s own error else.
    `what`: the errors' first words (the call given up).
    """
    probes = {ps: _probe_of(ps) for ps in range(num_ps)}
    try:
        _probe_all(probes, hang_timeout, describe_ps, "nothing was written", what)
    except tf.errors.OpError:
        # A ps answered with an error (gone, not hung), as in the loop below: left to fail the
        # export's own calls. Raised here, it failed the `fit` of a chaos plan whose probe of a
        # ps that answered hit TF's "Unable to find the relevant tensor remote_handle".
        pass
    publication = Publication()
    done = threading.Event()
    outcome: dict[str, Any] = {}

    def run():
        try:
            # An executor of the thread's own (not TF's default one, which a reconnect waits for and
            # whose stream to a ps carries other threads' errors); its registrations streamed.
            with on_thread_executor(), streamed_function_registrations():
                outcome["result"] = write(publication)
        except BaseException as error:  # noqa: BLE001 - handed to the caller (or dropped if it gave up)
            outcome["error"] = error
        finally:
            done.set()

    # Daemon: an export given up on waits on a hung ps, and must not keep the process from exiting.
    thread = threading.Thread(target=run, name=THREAD_NAME, daemon=True)
    thread.start()
    _wait_probing(done.wait, publication, probes, hang_timeout, describe_ps,
                  "the version being written is not published", what)
    thread.join()
    if "error" in outcome:
        if isinstance(outcome["error"], tf.errors.OpError):
            _name_a_lost_ps(probes, hang_timeout, describe_ps, outcome["error"], what)
        raise outcome["error"]
    return outcome["result"]


def wait_bounded(done: Callable[[float | None], bool], publication: Publication, num_ps: int,
                 hang_timeout: float, describe_ps: Callable[[int], str], what: str) -> None:
    """Wait for a write running on another thread (`done(timeout)`: whether it ended, waiting at most
    `timeout` s; None: until it ends), every ps probed meanwhile as `export_bounded` probes them.
    A ps that does not answer within `hang_timeout`: the write is abandoned (it must raise `Abandoned`
    instead of publishing once `publication.may_publish()` is False) and `PSUnavailableError` names
    the ps, the first words `what`."""
    probes = {ps: _probe_of(ps) for ps in range(num_ps)}
    _wait_probing(done, publication, probes, hang_timeout, describe_ps, "what was being written is not published",
                  what)


def _wait_probing(done: Callable[[float | None], bool], publication: Publication, probes: dict, hang_timeout: float,
                  describe_ps: Callable[[int], str], consequence: str, what: str) -> None:
    while not done(PROBE_EVERY_S):
        try:
            _probe_all(probes, hang_timeout, describe_ps, consequence, what)
        except PSUnavailableError:
            if publication.abandon():
                raise
            break  # it is being renamed: a local step, waited for below
        except tf.errors.OpError:
            # A ps answered with an error (gone, not hung): the write's own calls there fail too, and
            # it ends with its own error (what it cannot finish is never published).
            continue
    done(None)


def _name_a_lost_ps(probes: dict, hang_timeout: float, describe_ps: Callable[[int], str],
                    error: tf.errors.OpError, what: str) -> None:
    """Raise PSUnavailableError for a ps that fails a probe, chained to the export's `error`; return if
    every ps answers. TF's own error names the task in its text only.

    Every ps is probed at once, so this waits `hang_timeout` at most, not one per ps. A ps that
    answers with an error (gone: it is what failed the export) is named before one that does not
    answer in time, the lowest index first.
    """
    failed: dict[int, BaseException] = {}

    def probe(ps):
        def run():
            try:
                probes[ps]()
            except tf.errors.OpError as probe_error:
                failed[ps] = probe_error
        return run

    try:
        on_each_ps({ps: probe(ps) for ps in probes}, timeout=hang_timeout, probe=None)  # probes themselves
    except PsTimeout as timeout:
        failed.setdefault(timeout._psclient_ps, timeout)  # after any that answered with an error
    if not failed:
        return
    ps = min(failed, key=lambda p: (isinstance(failed[p], PsTimeout), p))
    raise PSUnavailableError(
        f"{what}: ps:{ps} ({describe_ps(ps)}) was lost during the export: it failed the "
        f"export's call ({first_line(error)}) and then a probe ({first_line(failed[ps])}). The "
        "version being written was not published; export again once the ps is back (ps recovery "
        "restores its variables from the strategy's checkpoint).",
        task=f"ps:{ps}", address=describe_ps(ps)) from error


def _probe_of(ps: int) -> Callable[[], None]:
    task = f"/job:ps/replica:0/task:{ps}"  # probe() names the task's CPU itself
    return lambda: _runtime.probe(task)


def _probe_all(probes: dict, hang_timeout: float, describe_ps: Callable[[int], str], consequence: str,
               what: str) -> None:
    try:
        on_each_ps(probes, timeout=hang_timeout, probe=None)  # probes themselves
    except PsTimeout as error:
        ps = error._psclient_ps
        raise PSUnavailableError(
            f"{what}: ps:{ps} ({describe_ps(ps)}) did not answer within hang_timeout="
            f"{hang_timeout:g} s (hung?); the export was given up and {consequence}. Export again once "
            f"it answers: {first_line(error)}", task=f"ps:{ps}", address=describe_ps(ps)) from error
