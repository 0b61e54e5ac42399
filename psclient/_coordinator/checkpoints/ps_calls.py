"""Calls on every ps task at once, each on a thread of its own, given up on a ps that stops answering.

Saves, restores and exports call each ps from a thread of its own with its own TF executor
(`on_each_ps`). A TF call cannot be cancelled, so a wait on a hung ps is bounded instead: the
call is given up on (`PsTimeout`, naming the ps) once its ps has answered nothing for `timeout`
seconds. Answers are not only the call's own end: while a call runs, its ps is probed once a
second (`runtime.probe`, a tiny op beside the call: a ps busy with a 44-s function answered
each probe within 13 ms, measured), so a long call on a ps that answers (a restore of a big
shard, a write to slow storage, a loaded machine) goes on, and a ps that stops (SIGSTOP, a hung
host) is given up on `timeout` after its last answer. (Bounded by the call's whole length
instead, a seeded chaos plan lost a ps for good: its restore, beside a test run on 2 cores, was
given up at the plan's 3-s `hang_timeout` three times running, the third time with no fault of the
plan on any task; docs/chaos.md.)
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Any, Callable

import tensorflow as tf

from psclient._coordinator import runtime as _runtime
from psclient._core.errors import PsTimeout
from psclient._tf import executors as _executors
from psclient._tf.registrations import until_registered

__all__ = ["Hearing", "THREAD_PREFIX", "late_threads", "on_each_ps", "probe_ps", "waiting_on"]

log = logging.getLogger("psclient")

#: The name of on_each_ps's threads: one still alive after its call returned waits on a ps given up on.
THREAD_PREFIX = "psclient-ckpt-ps"
#: The name of the threads that probe a ps while a call on it runs.
PROBE_THREAD_PREFIX = "psclient-ps-probe"
#: A call that runs this long gets its ps probed, and again this often while it runs.
PROBE_EVERY_S = 1.0
#: A call still running is logged this often (with whether its ps answers).
REPORT_EVERY_S = 30.0


def probe_ps(ps: int) -> None:
    """One round trip to ps task `ps` (`runtime.probe`); a negative index (the coordinator's own
    variables, `checkpoint_pieces.LOCAL`) needs none."""
    if ps >= 0:
        _runtime.probe(f"/job:ps/replica:0/task:{ps}")


def late_threads() -> list[threading.Thread]:
    """on_each_ps's threads alive now. Between calls: those still waiting on a ps a call gave
    up on (`timeout`): an eager TF call cannot be cancelled; each ends when its ps answers or dies."""
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]


def waiting_on(ps: int, grace: float = 0.0) -> bool:
    """Whether a thread of on_each_ps still waits on `ps` (between calls: on a call given up there),
    after waiting up to `grace` seconds in all for such threads to end."""
    name = f"{THREAD_PREFIX}{ps}"
    deadline = time.monotonic() + grace
    for thread in late_threads():
        if thread.name == name:
            thread.join(max(0.0, deadline - time.monotonic()))
    return any(thread.name == name for thread in late_threads())


class Hearing:
    """When each ps was last heard from, and which have been silent too long: the decision of
    `on_each_ps`'s wait, pure (every time is passed in: tests give their own).

    A ps is heard from when its call starts and at every probe it answers (with an error too: a
    ps that answers is not hung, and its call then ends with its own error). `progress`, where
    given, is the monotonic time of the work's last step, heard from every ps; -inf gives up on
    every ps at once (the caller wants the work stopped).
    """

    def __init__(self, tasks, started: float):
        self._heard = dict.fromkeys(tasks, started)

    def heard(self, ps: int, at: float) -> None:
        self._heard[ps] = max(self._heard[ps], at)

    def last(self, ps: int, progress: float | None = None) -> float:
        if progress is None:
            return self._heard[ps]
        return float("-inf") if progress == float("-inf") else max(self._heard[ps], progress)

    def silent(self, pending, now: float, timeout: float, progress: float | None = None) -> list[int]:
        """The `pending` ps heard from last more than `timeout` ago, lowest index first."""
        return sorted(ps for ps in pending if now - self.last(ps, progress) >= timeout)

    def wait_for(self, pending, now: float, timeout: float, progress: float | None = None) -> float:
        """Seconds until the first of `pending` has been silent `timeout` (0 if one has)."""
        if not pending:
            return 0.0
        return max(0.0, min(self.last(ps, progress) for ps in pending) + timeout - now)


def on_each_ps(work: dict[int, Callable[[], Any]], timeout: float | None = None,
               on_late: Callable[[Any], None] | None = None,
               progress: Callable[[], float] | None = None,
               probe: Callable[[int], None] | None = probe_ps) -> dict[int, Any]:
    """Run `work[ps]()` for every ps at once, each on a thread of its own with its own TF executor.

    Waits for all; raises the first error (by ps index) after every one ended. `timeout`: gives up
    on a ps heard from nothing for that long (see `Hearing`: its call's start, its answers to
    `probe(ps)`, made once a second while its call runs; `probe=None`: the call's start only, a
    bound on its whole length, for calls that are probes themselves) and raises PsTimeout naming
    the first such ps. Its thread goes on until its ps answers (a TF call cannot be cancelled);
    `on_late(future)` is told of each call still running, whose future ends when it does.
    """
    if not work:
        return {}
    futures: dict[int, concurrent.futures.Future] = {}
    threads = {}
    for ps in sorted(work):
        futures[ps] = concurrent.futures.Future()
        # Daemon: a thread left waiting on a hung ps must not keep the process from exiting.
        threads[ps] = threading.Thread(target=_run, args=(work[ps], futures[ps]), name=f"{THREAD_PREFIX}{ps}",
                                       daemon=True)
        threads[ps].start()
    if timeout is None:
        concurrent.futures.wait(futures.values())
    else:
        _bounded_wait(futures, timeout, on_late, progress, probe)
    for thread in threads.values():
        thread.join()
    for ps, future in futures.items():
        if future.exception() is not None:
            raise future.exception()
    return {ps: future.result() for ps, future in futures.items()}


def _run(call: Callable[[], Any], future: concurrent.futures.Future) -> None:
    if not future.set_running_or_notify_cancel():
        return
    executor = _executors.new_call_executor(streaming=False)
    try:
        # A function first traced here (a copy's or a cut's, a shard's restore) is registered on
        # every task: waited for, with the GIL held, a worker that had just stopped froze the
        # coordinator until it answered (tests/faults/test_no_freeze.py). Streamed instead, and
        # the work made again should a call overtake its function's registration.
        with _executors.executor_scope(executor), _executors.streamed_function_registrations():
            try:
                future.set_result(until_registered(call))
            except tf.errors.OpError as error:
                executor.clear_error()  # else it raises again when it is deleted
                future.set_exception(error)
    except BaseException as error:  # noqa: BLE001 - handed to the caller through its future
        executor.clear_error()  # a copy stopped (CopyStopped) after a call of it failed there
        if not future.done():
            future.set_exception(error)


def _bounded_wait(futures: dict[int, concurrent.futures.Future], timeout: float,
                  on_late: Callable[[Any], None] | None, progress: Callable[[], float] | None,
                  probe: Callable[[int], None] | None) -> None:
    """Wait for `futures` while every ps still running is heard from within `timeout`; else PsTimeout."""
    started = time.monotonic()
    hearing = Hearing(futures, started)
    ended = threading.Event()  # the probes' loops stop at it
    probing: set[int] = set()
    reported = started
    try:
        while True:
            pending = {ps for ps, future in futures.items() if not future.done()}
            now = time.monotonic()
            step = None if progress is None else progress()
            silent = hearing.silent(pending, now, timeout, step)
            if not pending or silent:
                break
            if probe is not None and now - started >= PROBE_EVERY_S:
                for ps in pending - probing:
                    probing.add(ps)
                    _start_probes(ps, futures[ps], probe, hearing, ended)
            if now - reported >= REPORT_EVERY_S:
                reported = now
                log.info("calls on ps %s have run %.0f s; each answered %s", sorted(pending), now - started,
                         ", ".join(f"ps:{ps} {now - hearing.last(ps):.1f} s ago" for ps in sorted(pending)))
            # Awake twice a second while probes or progress can move a deadline; else at the deadline.
            wait = hearing.wait_for(pending, now, timeout, step)
            if probe is not None or progress is not None:
                wait = min(wait, PROBE_EVERY_S / 2)
            concurrent.futures.wait([futures[ps] for ps in pending], timeout=max(wait, 0.01),
                                    return_when=concurrent.futures.FIRST_COMPLETED)
    finally:
        ended.set()
    if silent:
        for ps in sorted(pending):
            if on_late is not None:
                on_late(futures[ps])
        last = hearing.last(silent[0], step)
        message = f"no answer within {timeout:g} s (the ps may hang)"
        if probe is not None and started < last < now:
            message = (f"no answer within {timeout:g} s (the ps may hang: it answered its last probe "
                       f"{now - last:.1f} s ago, {now - started:.1f} s into the call)")
        error = PsTimeout(message)
        error._psclient_ps = silent[0]
        raise error


def _start_probes(ps: int, future: concurrent.futures.Future, probe: Callable[[int], None],
                  hearing: Hearing, ended: threading.Event) -> None:
    """Probe `ps` once a second on a thread of its own while its call runs; `hearing` hears each answer."""
    def run():
        while not ended.is_set() and not future.done():
            try:
                probe(ps)
            except tf.errors.OpError:
                pass  # it answered (gone or restarted): not hung; its call ends with its own error
            except (ValueError, RuntimeError) as error:  # TF could not send it (no such task now): not heard
                log.debug("probe of ps:%d not sent: %s", ps, error)
                return
            hearing.heard(ps, time.monotonic())
            ended.wait(PROBE_EVERY_S)

    # Daemon: a probe of a hung ps waits until it answers, and must not keep the process from exiting.
    threading.Thread(target=run, name=f"{PROBE_THREAD_PREFIX}{ps}", daemon=True).start()
