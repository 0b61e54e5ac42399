"""`LocalCluster.add_worker`: a worker task started on request, at a new port.

Kept apart from `local.py` (the fixed cluster) so that module stays small.
A new worker is owned exactly as the first ones: its process, pipes and
log are in the same list that `close()` (and the finalizer run at exit)
ends and reaps. The cluster grows by one worker address; the tasks started
before keep theirs (TF_CONFIG names the grown cluster only for the new task
and for tasks restarted later: any cluster that names a task's own address
serves it). A worker is retired with `kill("worker", index)`: its slot and
address stay, and `restart` brings it back at that address.
"""

from __future__ import annotations

import contextlib
import os

import portpicker

from psclient._cluster.spec import Cluster
from psclient._core.checks import check_positive

__all__ = ["ElasticWorkers"]

_HOST = "127.0.0.1"


class ElasticWorkers:
    """`add_worker` for `LocalCluster` (which provides the attributes used here)."""

    def add_worker(self, timeout: float | None = None) -> int:
        """Starts one more worker task at a new port on 127.0.0.1; returns its index.

        Waits until it serves (at most `timeout` s, default `start_timeout`).
        Its address is `cluster.address("worker", index)` (also the last of
        `cluster.workers`); give it to `ParameterServerStrategy.add_worker`.

        Raises:
            TaskUnreachableError: the new process exited or was not ready in
                time (it is ended, and the cluster is as before).
            RuntimeError: the cluster is closed.
        """
        check_positive("timeout", timeout, optional=True, unit="seconds")
        with self._lock:
            self._check_open()
            index = self._cluster.num_workers
            taken = {address for addresses in self._cluster.jobs.values() for address in addresses}
            address = f"{_HOST}:{portpicker.pick_unused_port()}"
            while address in taken:  # the reserved chief port is free too: portpicker may offer it
                address = f"{_HOST}:{portpicker.pick_unused_port()}"
            jobs = self._cluster.jobs
            jobs["worker"].append(address)
            grown = Cluster(jobs)
            task = self._TASK("worker", index, address, os.path.join(self._log_dir, f"worker-{index}.log"))
            previous, self._cluster = self._cluster, grown
            with contextlib.ExitStack() as on_failure:  # a worker that did not start leaves no trace
                on_failure.callback(task.reap)
                on_failure.callback(setattr, self, "_cluster", previous)
                self._start([task], self._start_timeout if timeout is None else timeout)
                on_failure.pop_all()
            self._tasks[("worker", index)] = task
            self._task_list.append(task)  # owned: close() and the finalizer end it
            return index
