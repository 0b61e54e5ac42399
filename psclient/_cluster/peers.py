"""The addresses a task's port admits, kept current: `psclient serve`'s peers.

`psclient serve` drops every packet to its port that comes neither over
loopback nor from a peer (exposure.py; `--allow-any-host` turns that off).
The peers are every address of:
- the cluster's hosts (all jobs but "evaluator"), which must resolve at
  start: a typo fails there, not later as a coordinator that cannot connect;
- `--peer-hosts`: hosts that may not resolve yet (Kubernetes pods not yet
  scheduled, worker slots a StatefulSet has not been scaled to), each
  admitted once it resolves. A cluster host named there too may also wait;
- `--peers-file FILE`: the hosts of a JSON cluster file (the format of
  `--cluster` and of `WorkerWatcher`: the file the operator rewrites as
  workers come and go), read again whenever it changes, for workers that
  join later from other hosts. A file that cannot be read or parsed, or
  names a host that does not resolve, is said once and changes nothing.

Names are resolved again every few seconds: a peer that comes back at
another address behind the same name (a rescheduled pod) is admitted, and
its old address dropped for new connections (one already made stays, as
TF's channels do); a name that stops resolving keeps its last addresses.
A cluster of IP addresses alone, without a peers file, never changes: its
filter is locked once set.
"""

from __future__ import annotations

import ipaddress
import os
import threading
import time
from collections.abc import Callable, Iterable

from psclient._cluster import exposure
from psclient._cluster.spec import Cluster
from psclient._core.errors import ClusterConfigError

__all__ = ["Peers", "cluster_hosts"]


def cluster_hosts(cluster: Cluster) -> list[str]:
    """The hosts of every task that talks to a task server: all jobs but "evaluator"."""
    return sorted({address.rsplit(":", 1)[0] for job, addresses in cluster.jobs.items()
                   if job != "evaluator" for address in addresses})


def is_name(host: str) -> bool:
    """Whether `host` is a DNS name (its addresses may change), not an IP address."""
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return True
    return False


class Peers:
    """Keeps a task's port open to its peers' addresses, and to nobody else but loopback.

    Args:
        hosts: the cluster's hosts; each must resolve at `start()`.
        port: the task's port, restricted in this process.
        what: the task's name for messages ("ps:0").
        say: where messages go (a line each).
        later: hosts admitted once they resolve (`--peer-hosts`).
        path: a cluster file whose hosts are admitted too (`--peers-file`).
        interval: seconds between looks at the file (its mtime and size).
        resolve_every: seconds between resolutions of the names.
        resolve: `exposure.resolve_peers` (a fake in tests).
        restrict: `exposure.restrict_port` (a fake in tests).
    """

    def __init__(self, hosts: Iterable[str], port: int, *, what: str, say: Callable[[str], None],
                 later: Iterable[str] = (), path: str | os.PathLike | None = None, interval: float = 2.0,
                 resolve_every: float = 4.0, resolve: Callable = exposure.resolve_peers,
                 restrict: Callable = exposure.restrict_port):
        self._later = sorted(set(later))
        self._strict = sorted(set(hosts) - set(self._later))
        self._port = port
        self._what = what
        self._say = say
        self._path = None if path is None else os.fspath(path)
        self._interval = interval
        self._resolve_every = resolve_every
        self._resolve = resolve
        self._restrict = restrict
        self._addresses: dict[str, frozenset] = {}  # host -> its addresses, as last resolved
        self._file_hosts: list[str] = []
        self._seen: tuple | None = None  # (mtime_ns, size) of the file last read
        self._problem: str | None = None
        self._waiting: set[str] = set()  # later hosts said not to resolve yet
        self._resolved_at = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Every address ever admitted: a connection it made then is no
        # intrusion later (connections stay when their host is dropped).
        self._admitted: set = set()
        #: The peer addresses in force on the port (empty until `restrict()`).
        self.peers: set = set()

    @property
    def changing(self) -> bool:
        """Whether the peers can change while the task runs (names, or a peers file)."""
        return self._path is not None or any(is_name(h) for h in (*self._strict, *self._later))

    def _resolve_host(self, host: str) -> frozenset:
        return frozenset(self._resolve([host]))

    def start(self) -> set:
        """Resolves every host (and reads the file); returns the addresses to admit.

        Raises:
            PortExposedError: a cluster host, or a host the file names, does not resolve.
            ClusterConfigError: the peers file is unreadable or not a valid cluster.
        """
        for host in self._strict:
            self._addresses[host] = self._resolve_host(host)
        self._resolve_later()
        if self._path is not None:
            self._seen = self._file_stat()
            self._read_file()
        self._resolved_at = time.monotonic()
        return self.wanted()

    def wanted(self) -> set:
        """Every address of every host known now."""
        return set().union(*self._addresses.values())

    def _resolve_later(self) -> None:
        for host in self._later:
            try:
                self._addresses[host] = self._resolve_host(host)
            except exposure.PortExposedError:
                if host not in self._addresses and host not in self._waiting:
                    self._waiting.add(host)
                    self._say(f"{self._what}: {host} does not resolve yet; admitted once it does")
                continue  # keeps its last addresses, if it had some
            self._waiting.discard(host)

    def _file_stat(self) -> tuple | None:
        try:
            stat = os.stat(self._path)
        except OSError:
            return None
        return (stat.st_mtime_ns, stat.st_size)

    def _read_file(self) -> None:
        """The file's hosts replace the previous file's; all of them must resolve.

        Raises:
            ClusterConfigError, PortExposedError: as `start()`; nothing changes then.
        """
        hosts = cluster_hosts(Cluster.from_file(self._path))
        resolved = {host: self._resolve_host(host) for host in hosts}
        for host in self._file_hosts:
            if host not in resolved and host not in self._strict and host not in self._later:
                del self._addresses[host]
        self._addresses.update(resolved)
        self._file_hosts = hosts

    def restrict(self, addresses: set) -> None:
        """Puts `addresses` in force on the port: locked when nothing can change them.

        Raises:
            PortExposedError: as `exposure.restrict_port`.
        """
        self._restrict(self._port, addresses, what=self._what, lock=not self.changing,
                       established_ok=self._admitted)
        self.peers = set(addresses)
        self._admitted |= self.peers

    def refresh(self, now: float | None = None) -> bool:
        """Reads the file if it changed and resolves the names again when due;
        puts the result in force. True if the peers changed.

        Raises:
            PortExposedError: the kernel refused the new filter, or a stranger
                got in (cannot happen while the old filter holds).
        """
        now = time.monotonic() if now is None else now
        if self._path is not None:
            seen = self._file_stat()
            if seen is None or seen != self._seen:
                try:
                    self._read_file()
                except (ClusterConfigError, exposure.PortExposedError) as e:
                    if str(e) != self._problem:  # once per problem
                        self._say(f"error: {self._what}: peers file: {e}; the peers in force stay")
                    self._problem = str(e)
                else:
                    self._seen, self._problem = seen, None
        if now - self._resolved_at >= self._resolve_every:
            self._resolved_at = now
            for host in {*self._strict, *self._file_hosts} - set(self._later):
                if is_name(host):
                    try:
                        self._addresses[host] = self._resolve_host(host)
                    except exposure.PortExposedError:
                        continue  # keeps its last addresses: a DNS hiccup shuts nobody out
            self._resolve_later()
        wanted = self.wanted()
        if wanted == self.peers:
            return False
        self.restrict(wanted)
        self._say(f"{self._what} admits {', '.join(sorted(str(p) for p in wanted))}, and loopback")
        return True

    def watch(self, on_error: Callable[[BaseException], None]) -> threading.Thread | None:
        """Refreshes every `interval` s in a daemon thread, until `stop()`; None when
        nothing can change (no thread)."""
        if not self.changing:
            return None

        def run() -> None:
            while not self._stop.wait(self._interval):
                try:
                    self.refresh()
                except exposure.PortExposedError as e:
                    on_error(e)
                    return

        # A daemon: the task process ends with os._exit, which no thread may hold up.
        self._thread = threading.Thread(target=run, name="psclient-peers", daemon=True)
        self._thread.start()
        return self._thread

    def stop(self, timeout: float | None = None) -> None:
        """Ends the watch thread and joins it (for at most `timeout` s)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
