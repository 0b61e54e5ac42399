"""The peers a task admits while its cluster changes: `psclient serve --peers-file FILE`.

With `--restrict-to-peers`, a task's port drops every packet that comes
neither over loopback nor from the cluster's hosts, resolved once at start
(exposure.py). A worker that joins later from another host would be dropped
by every ps task. `--peers-file` names a JSON cluster file (the format of
`--cluster` and of `WorkerWatcher`: the file the operator rewrites as
workers come and go): the hosts of every job in it but "evaluator" are
admitted too, and the file is read again whenever it changes. The port is
never opened to everyone: only hosts a cluster file names get in, on top of
the start-up cluster's, and a host that leaves the file is dropped again
for new connections (one already made stays, as TF's channels do).

A file that cannot be read or parsed, or names a host that does not
resolve, is logged once and changes nothing: the peers in force stay.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable

from psclient._cluster import exposure
from psclient._cluster.spec import Cluster
from psclient._core.errors import ClusterConfigError

__all__ = ["PeerFile", "cluster_hosts"]


def cluster_hosts(cluster: Cluster) -> list[str]:
    """The hosts of every task that talks to a task server: all jobs but "evaluator"."""
    return sorted({address.rsplit(":", 1)[0] for job, addresses in cluster.jobs.items()
                   if job != "evaluator" for address in addresses})


class PeerFile:
    """Keeps a task's port open to the start-up hosts plus those a cluster file names.

    Args:
        path: the cluster file.
        base: peer addresses admitted whatever the file says (the start-up cluster's).
        port: the task's port, restricted in this process.
        what: the task's name for messages ("ps:0").
        say: where messages go (a line each).
        interval: seconds between looks at the file (its mtime and size).
        restrict: `exposure.restrict_port` (a fake in tests).
    """

    def __init__(self, path: str | os.PathLike, base: Iterable, port: int, *, what: str,
                 say: Callable[[str], None], interval: float = 2.0,
                 restrict: Callable = exposure.restrict_port):
        self._path = os.fspath(path)
        self._base = set(base)
        self._port = port
        self._what = what
        self._say = say
        self._interval = interval
        self._restrict = restrict
        self._seen: tuple | None = None  # (mtime_ns, size) of the file last read
        self._problem: str | None = None
        self._stop = threading.Event()
        #: The peer addresses in force.
        self.peers: set = set(self._base)

    def wanted(self) -> set:
        """The base peers and every address the file's hosts resolve to.

        Raises:
            ClusterConfigError: the file is unreadable or not a valid cluster.
            PortExposedError: a host it names does not resolve.
        """
        return self._base | exposure.resolve_peers(cluster_hosts(Cluster.from_file(self._path)))

    def apply(self, peers: set) -> None:
        """Put `peers` in force on the port (the filter is replaced, never locked)."""
        self._restrict(self._port, peers, what=self._what, lock=False, established_ok=self.peers)
        self.peers = set(peers)
        self._say(f"{self._what} admits {', '.join(sorted(str(p) for p in peers))} "
                  f"(from {self._path!r}), and loopback")

    def check(self) -> bool:
        """Read the file if it changed and apply its peers; True if they changed.

        Raises:
            PortExposedError: the kernel refused the new filter, or a stranger
                got in (cannot happen while the old filter holds).
        """
        try:
            stat = os.stat(self._path)
            seen = (stat.st_mtime_ns, stat.st_size)
        except OSError:
            seen = None
        if seen is not None and seen == self._seen:
            return False
        try:
            peers = self.wanted()
        except (ClusterConfigError, exposure.PortExposedError) as e:
            if str(e) != self._problem:  # once per problem
                self._say(f"error: {self._what}: peers file: {e}; the peers in force stay")
            self._problem = str(e)
            return False
        self._seen, self._problem = seen, None
        if peers == self.peers:
            return False
        self.apply(peers)
        return True

    def watch(self, on_error: Callable[[BaseException], None]) -> threading.Thread:
        """Check the file every `interval` s in a daemon thread, until `stop()`."""

        def run() -> None:
            while not self._stop.wait(self._interval):
                try:
                    self.check()
                except exposure.PortExposedError as e:
                    on_error(e)
                    return

        thread = threading.Thread(target=run, name="psclient-peers-file", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self._stop.set()
