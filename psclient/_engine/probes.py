"""Bounded probes a dispatcher thread makes to classify a failed call.

Never text matching: a task that answers a tiny op is healthy. What a verdict
means for a task is the recovery machine's decision (psclient._core.recovery_machine);
`Published` is what it last decided, read here without locks.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from psclient._core.tcp_state import TcpState
from psclient._engine.edge import Edge, Roster
from psclient._core.health import Prober
from psclient._core.scheduler import Scheduler

__all__ = ["FailureProbes", "Published"]


class Published:
    """What the machine last decided, for dispatcher threads to read (replaced whole)."""

    def __init__(self, num_workers: int):
        self.view = frozenset(range(num_workers))
        self.ps_down = frozenset()
        self.epochs = (0,) * num_workers
        self.ps_epoch = 0


class FailureProbes:
    """Bounded probes a dispatcher makes to classify a failed call."""

    def __init__(self, roster: Roster, prober: Prober, scheduler: Scheduler, published: Published,
                 probe_timeout: float, edge: Edge, held: Callable[[], dict] = dict):
        # `held()`: a variable on each ps task that holds any (`VariableStore.one_per_ps`);
        # `edge.check_handle(variable)` raises if its task no longer holds it.
        self._held = held
        self._edge = edge
        self._roster = roster
        self._prober = prober
        self._scheduler = scheduler
        self._published = published
        self._probe_timeout = probe_timeout

    def answers(self, device: str, attempts: int = 3, spacing: float = 0.2) -> bool:
        """Whether the task answers one of a few probes.

        Right after one task dies, TF's runtime can fail a call (and a probe)
        on a healthy task for a moment; a dead task fails every probe. A probe
        that times out is not repeated: the task is hung.
        """
        return not self._not_answering({device: device}, attempts, spacing)

    def _not_answering(self, devices: dict, attempts: int = 3, spacing: float = 0.2) -> list:
        """The keys of `devices` whose task answers none of a few probes.

        Every task is probed at once, against one deadline per round, so
        judging a thousand workers takes one probe's time, not a thousand.
        """
        pending, silent = dict(devices), []
        for attempt in range(attempts):
            if not pending:
                break
            if attempt:
                time.sleep(spacing)  # spacing between probes, not synchronisation
            timed_out, failed = self._probe_round(pending)
            silent += timed_out  # hung: not asked again
            pending = {key: pending[key] for key in failed}
        return silent + list(pending)

    def _probe_round(self, devices: dict) -> tuple[list, list]:
        """One probe of every device in `devices` at once, against one deadline (probe_timeout):
        (the keys whose probe timed out, the keys whose probe failed)."""
        # Ahead of the heartbeats in the prober's queue: a burst of them (a hundred
        # workers on a loaded coordinator) must not time these out before they run.
        probes = {key: self._prober.start(device, urgent=True) for key, device in devices.items()}
        deadline = time.monotonic() + self._probe_timeout
        timed_out, failed = [], []
        for key, probe in probes.items():
            if not probe.done.wait(max(0.0, deadline - time.monotonic())):
                timed_out.append(key)
            elif not probe.ok:
                failed.append(key)
        return timed_out, failed

    def lost_ps(self) -> tuple:
        """The ps tasks that do not answer, or that answer but no longer hold
        their variables (restarted: `stale_ps`). Those known lost without probing."""
        known = self._published.ps_down
        if known:
            return tuple(sorted(known))
        silent = set(self._not_answering(self._ps_tasks()))
        stale, late = self._check_handles({ps: v for ps, v in self._held().items() if ps not in silent})
        return tuple(sorted(silent | set(stale) | set(late)))

    def hung_ps(self) -> tuple:
        """The ps tasks that leave one probe unanswered within probe_timeout (hung: SIGSTOP, a cut
        network). One that answers with an error (gone) is not among them: TF's calls fail there
        at once instead of waiting."""
        return tuple(self._probe_round(self._ps_tasks())[0])

    def _ps_tasks(self) -> dict:
        """ps index -> its task's device name (no "/device:" part: what a probe asks)."""
        return {ps: self._edge.ps_device(ps).rsplit("/device:", 1)[0] for ps in range(self._roster.cluster.num_ps)}

    def stale_ps(self, skip: set = frozenset()) -> tuple:
        """The ps tasks that answer that they no longer hold this coordinator's variables.

        A ps restarted behind the coordinator's back answers probes once any
        reconnect has introduced the new process, but the variables' handles
        name the old one: every read fails ("invalid device") until they are
        made again and restored. A ps that does not answer the check in time
        is not among them: it hangs (SIGSTOP, a cut network) and holds its
        variables as they were, so restoring it would undo its updates since
        the checkpoint for nothing (the hang's own path applies: its closures
        wait, and if it was restarted meanwhile, the next call or check that
        reaches it says so).
        """
        return self._check_handles({ps: v for ps, v in self._held().items() if ps not in skip})[0]

    def holding(self, ps_tasks: tuple) -> tuple:
        """Those of `ps_tasks` that answer holding this coordinator's variables (a ps that holds
        none of them, or does not answer within probe_timeout, is not among them)."""
        wanted = set(ps_tasks)
        held = {ps: v for ps, v in self._held().items() if ps in wanted}
        stale, late = self._check_handles(held)
        return tuple(ps for ps in ps_tasks if ps in held and ps not in stale and ps not in late)

    def _check_handles(self, held: dict) -> tuple[tuple, tuple]:
        """(the ps of `held` (ps -> one of its variables) whose handle check failed, those that
        did not answer it within probe_timeout): one shape op per ps, all at once."""
        results: dict[int, bool] = {}

        def check(ps: int, variable: Any) -> None:
            try:
                self._edge.check_handle(variable)
                results[ps] = True
            except self._edge.op_error():
                results[ps] = False

        threads = [threading.Thread(target=check, args=item, name=f"psclient-ps-check{item[0]}", daemon=True)
                   for item in held.items()]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + self._probe_timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        answered = dict(results)  # a late thread may still write: read once
        stale = tuple(sorted(ps for ps in held if answered.get(ps) is False))
        late = tuple(sorted(ps for ps in held if ps not in answered))
        return stale, late

    def worker_answers(self, worker: int) -> bool:
        """Whether `worker` answers, or cannot be judged yet.

        A gone worker still in TF's view makes calls (and probes) on the healthy
        ones fail too: while one is there (its TCP connect is refused), this
        worker is not judged; the gone one is (see `lost_workers`).
        """
        if self.answers(self._edge.worker_device(worker)):
            return True
        return any(
            w != worker and self._edge.tcp_state(self._roster.cluster.address("worker", w), 1.0) == TcpState.CLOSED
            for w in self._published.view
        )

    def lost_workers(self, worker: int) -> list[int]:
        """The other workers in rotation that do not answer."""
        return sorted(self._not_answering({
            other: self._edge.worker_device(other) for other in range(self._roster.cluster.num_workers)
            if other != worker and self._scheduler.worker_is_up(other)
        }))

    def view(self) -> frozenset:
        """The workers in TF's view of the cluster (as the recovery thread last connected)."""
        return self._published.view

    def epochs(self) -> tuple:
        return self._published.epochs

    def ps_epoch(self) -> int:
        return self._published.ps_epoch
