"""Task processes forked from a starter that imported TensorFlow once.

Importing TensorFlow is most of what starting a task costs: about 3 CPU
seconds of the 3.4 a `psclient serve` process spends until it serves,
measured on a 2-core machine (`benchmarks/cluster_start.py`). A
`LocalCluster` therefore asks a *fork server* for its tasks: one
`python -m psclient serve --fork-server FD` process that imports TensorFlow
(not Keras, as any task) and then, for each request, forks a child that
becomes the task: its own session, its log as stdout and stderr, its
environment, and `psclient serve`'s own `main` with the request's options.
TensorFlow starts no thread at import (only OpenBLAS does, and it restarts
its threads in a forked child), so the child builds its runtime afresh,
as an exec'd process would.

Ownership stays as before. A task keeps the two pipes to its
coordinator (`task_process`): it exits when the coordinator is gone, and its
parent-death signal now names the fork server, which exits when the
coordinator closes its end of the control socket (also by dying). The fork
server reaps its children and reports each exit status; the coordinator
signals a task through a pidfd, which never reaches a later process that
reused the pid.

One fork server serves every cluster of a process whose tasks get the same
environment (TF_CONFIG aside: each task's own), so a test run imports
TensorFlow in one process instead of in every task it starts. It exits by
itself after `fork_serving.IDLE_EXIT_S` without a task or a request; the
next request starts another. Its own side is `fork_serving.py`.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from psclient._cluster.fork_serving import MESSAGE_BYTES, OPTION

__all__ = ["READER_THREAD_NAME", "ForkServer", "ForkServerGone", "ForkServerTimeout", "ForkedProcess", "server_for",
           "supported"]

#: The name of each fork server's reader thread in its owner's process: it lives as long as its
#: server, which serves every LocalCluster of the process and exits once idle (`IDLE_EXIT_S`).
READER_THREAD_NAME = "psclient-fork-server"

#: How often a wait checks whether the fork server is gone (then nobody would report the status).
_ORPHAN_CHECK_S = 0.5


def supported() -> bool:
    """Linux with pidfds (kernel 5.3+) and fd passing: elsewhere tasks are started as processes of their own."""
    if not sys.platform.startswith("linux") or not hasattr(os, "pidfd_open") or not hasattr(socket, "send_fds"):
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:
        return False
    return True


class ForkServerTimeout(TimeoutError):
    """The fork server did not fork the task in the time given (still importing TensorFlow, or stopped)."""


class ForkServerGone(OSError):
    """The fork server exited before it answered (it idled out, or died): start another."""


class ForkedProcess:
    """A task forked by a fork server, with what `LocalCluster` uses of `subprocess.Popen`."""

    def __init__(self, pid: int, args: list[str], server: ForkServer):
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._server = server
        self._done = threading.Event()
        self._lock = threading.Lock()  # the pidfd is closed once, never under a signal being sent
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:  # exited (and reaped) already: its status is on its way
            self._pidfd = None

    def _exited(self, code: int) -> None:
        with self._lock:
            if self._done.is_set():
                return
            self.returncode = code
            if self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None
            self._done.set()

    def _orphaned(self, timeout: float) -> None:
        """Its fork server is gone, so nobody reports its status: it exits by itself (its
        parent-death signal names the server); wait for that on the pidfd. Status unknown: -1."""
        with self._lock:  # our own copy: another caller's `_exited` may close the pidfd meanwhile
            fd = None if self._pidfd is None else os.dup(self._pidfd)
        try:
            ended = fd is None or bool(select.select([fd], [], [], timeout)[0])
        finally:
            if fd is not None:
                os.close(fd)
        if ended:
            self._exited(-1)

    def poll(self) -> int | None:
        if self.returncode is None and self._server.gone:
            self._orphaned(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done.is_set():
            left = _ORPHAN_CHECK_S if deadline is None else min(_ORPHAN_CHECK_S, deadline - time.monotonic())
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            if self._server.gone:
                self._orphaned(left)
            else:
                self._done.wait(left)  # set by the server's report; its exit is checked between slices
        return self.returncode

    def send_signal(self, sig: int) -> None:
        with self._lock:
            if self._pidfd is None:
                return
            try:
                signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:
                pass  # exited; its status is on its way

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """One fork server process and the thread that reads what it reports."""

    def __init__(self, env: dict[str, str]):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "psclient", "serve", OPTION, str(theirs.fileno())],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                env=env, pass_fds=(theirs.fileno(),), start_new_session=True)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._sock = ours
        self._cond = threading.Condition()
        self._replies: dict[Any, dict] = {}  # request id -> its answer; ("exit", pid) -> an early exit
        self._abandoned: set[int] = set()  # requests given up on: their answers, and exits, are dropped
        self._unwanted: set[int] = set()
        self._forked: dict[int, ForkedProcess] = {}
        self._next_id = 0
        self.gone = False
        self._owner = os.getpid()
        self._reader = threading.Thread(target=self._read, name=READER_THREAD_NAME, daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self._process.pid

    def spawn(self, argv: list[str], env: dict[str, str], log_path: str, fds: dict[str, int],
              timeout: float) -> ForkedProcess:
        """Fork a `psclient serve` task: `argv` its options, `fds` option -> an fd of this process
        that the task gets as that option's value (its copy: ours stay open)."""
        with self._cond:
            if self.gone:
                raise ForkServerGone("the fork server has exited")
            self._next_id += 1
            request_id = self._next_id
        request = {"id": request_id, "argv": argv, "env": env, "log": log_path, "fd_options": list(fds)}
        try:
            socket.send_fds(self._sock, [json.dumps(request).encode()], list(fds.values()))
        except OSError as error:
            raise ForkServerGone(f"the fork server has exited ({error})") from error
        deadline = time.monotonic() + timeout
        with self._cond:
            while request_id not in self._replies:
                left = deadline - time.monotonic()
                if self.gone:
                    raise ForkServerGone("the fork server exited before it answered")
                if left <= 0:
                    # Forked later, the task finds its pipes closed by the caller and exits.
                    self._abandoned.add(request_id)
                    raise ForkServerTimeout(f"the fork server did not answer within {timeout:g} s")
                self._cond.wait(left)
            reply = self._replies.pop(request_id)
            if "error" in reply:
                raise OSError(f"the fork server could not start the task: {reply['error']}")
            process = ForkedProcess(reply["pid"], ["psclient", "serve", *argv], self)
            self._forked[process.pid] = process
            exited = self._replies.pop(("exit", process.pid), None)
        if exited is not None:  # reported before we knew the pid
            process._exited(exited["code"])
        return process

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(MESSAGE_BYTES)
            except OSError:
                data = b""
            if not data:
                break
            message = json.loads(data)
            with self._cond:
                process = None
                if "exit" in message:
                    process = self._forked.pop(message["exit"], None)
                    if process is None and message["exit"] not in self._unwanted:
                        self._replies[("exit", message["exit"])] = message
                    self._unwanted.discard(message["exit"])
                elif message["id"] in self._abandoned:
                    self._abandoned.discard(message["id"])
                    if "pid" in message:
                        self._unwanted.add(message["pid"])
                else:
                    self._replies[message["id"]] = message
                self._cond.notify_all()
            if process is not None:
                process._exited(message["code"])
        with self._cond:
            self.gone = True  # its tasks exit by themselves now (their parent-death signal)
            self._forked.clear()
            self._cond.notify_all()
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:  # it exits at EOF: this one is stuck (stopped?)
            self._process.kill()
            self._process.wait()

    def close(self) -> None:
        """End the fork server (EOF on its socket) and join the reader. Its tasks, if any are
        left, exit by themselves (their parent-death signal)."""
        if os.getpid() != self._owner:
            return
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already gone
        self._reader.join(timeout=30)
        self._sock.close()


#: Variables read only once a task runs (its TF_CONFIG; gRPC's, read when its server starts): a
#: fork server serves tasks whose other variables are its own (some are read at start-up or at
#: TensorFlow's import: PYTHONPATH, MALLOC_*, TF_ENABLE_ONEDNN_OPTS).
_SET_IN_EACH_TASK = frozenset({"TF_CONFIG", "GRPC_FAIL_FAST"})
_servers: dict[tuple, ForkServer] = {}
_servers_lock = threading.Lock()


def server_for(env: dict[str, str]) -> ForkServer:
    """The fork server of this process for tasks given `env` (TF_CONFIG aside), started if none runs."""
    key = tuple(sorted((k, v) for k, v in env.items() if k not in _SET_IN_EACH_TASK))
    with _servers_lock:
        server = _servers.get(key)
        if server is None or server.gone:
            if server is not None:
                server.close()
            server = _servers[key] = ForkServer(dict(key))
        return server


def _close_all() -> None:
    with _servers_lock:
        servers = list(_servers.values())
        _servers.clear()
    for server in servers:
        server.close()


def _forget_in_child() -> None:
    # A forked child of this process is not their owner: it closes its copies of the sockets
    # (so that the servers still see EOF when this process dies) and never signals them.
    for server in _servers.values():
        server._sock.close()
    _servers.clear()


atexit.register(_close_all)
os.register_at_fork(after_in_child=_forget_in_child)

