"""Running one TensorFlow task server (a worker or ps task): the body of `psclient serve`.

A task server is a `tf.distribute.Server` that holds variables (ps) or runs
functions (worker) for the coordinator. This module starts one, reports when it
is ready, and ends it cleanly: on SIGTERM or SIGINT it exits with status 0, and
when started by `LocalCluster` it also exits as soon as its parent process is
gone, however the parent died.

TensorFlow is imported only inside `serve`, after GRPC_FAIL_FAST is set, and
without the Keras import that TensorFlow's own import makes (`_import_tensorflow`).
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, NoReturn

from psclient._cluster import exposure
from psclient._cluster.peers import Peers, cluster_hosts
from psclient._cluster.spec import Cluster
from psclient._core.checks import check_positive
from psclient._core.recycling import IdleRecycler, TaskLoad

SERVED_JOBS = ("worker", "ps")

_UNAUTHENTICATED = (
    "WARNING: TensorFlow task servers accept unauthenticated RPCs: anyone who can "
    "reach this port can read and change its variables and run code in this process. "
)

SECURITY_WARNING = _UNAUTHENTICATED + (
    "TensorFlow also binds the port on ALL network interfaces, even for a 127.0.0.1 "
    "address, and has no option to bind only one. Run tasks only on a trusted network."
)

ANY_HOST_WARNING = _UNAUTHENTICATED + (
    "With --allow-any-host this task's port is open to EVERY host that can reach this "
    "machine, on every network interface (TensorFlow binds them all): nothing but your "
    "network keeps strangers out. Without it the port admits only loopback and the "
    "cluster's hosts."
)

RESTRICTED_WARNING = _UNAUTHENTICATED + (
    "TensorFlow binds the port on ALL network interfaces; this task's port drops every "
    "packet that comes neither over loopback nor from the cluster's own hosts ({peers}): "
    "any process on this machine or on those hosts can still reach it."
)


LOCAL_WARNING = _UNAUTHENTICATED + (
    "TensorFlow binds the ports on ALL network interfaces; those of this local cluster "
    "drop every packet that does not come over loopback: any process on this machine "
    "can still reach them."
)


def local_security_warning() -> str:
    """What `launch` and `demo` say about their local cluster's ports."""
    return LOCAL_WARNING if exposure.supported() else SECURITY_WARNING


#: The hosts of every task that talks to a task server: all jobs but "evaluator".
peer_hosts = cluster_hosts


def default_inter_op_threads(cluster: Cluster) -> int:
    """At least one inter-op thread per worker, plus one (see check_inter_op_threads)."""
    return max(os.cpu_count() or 2, cluster.num_workers + 1)


def check_inter_op_threads(value: int, *, name: str = "argument `inter_op_threads`") -> int:
    """Rejects thread counts that deadlock the runtime.

    With one inter-op thread, a worker running a function that reads a variable
    on a ps task blocks that thread on the remote read and never returns.
    """
    if not isinstance(value, int) or isinstance(value, bool) or value < 2:
        raise ValueError(
            f"Invalid value for {name}. Received: {value!r}. "
            "Expected an integer >= 2: with 1 thread, a worker that reads variables "
            "on a ps task deadlocks."
        )
    return value


def local_address_problem(address: str) -> str | None:
    """Why `host:port` cannot be served on this host (None if it can).

    A host is local when one of the addresses it resolves to can be bound
    here (port 0: the task's own port is left alone).
    """
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as e:
        return f"its host {host!r} does not resolve ({e.strerror})"
    resolved = sorted({info[4][0] for info in infos})
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((sockaddr[0], 0, *sockaddr[2:]))
            except OSError:
                continue
            return None
    return (f"its host {host!r} ({', '.join(resolved)}) is not an address of this machine: run "
            "`psclient serve` on the host the cluster names for this task")


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _exit(code: int) -> NoReturn:
    """Exits at once: TensorFlow's destructors can hang a normal interpreter exit."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class _StopSignals:
    """Wakes the main thread on SIGTERM or SIGINT, whichever thread receives it.

    `server.join()` cannot be interrupted, so the main thread waits here instead.
    It cannot wait on a `threading.Event` set by a Python signal handler: the
    kernel delivers a process signal to any thread, often one of TensorFlow's,
    and Python then runs the handler only when the main thread next executes
    bytecode, which a main thread blocked in `Event.wait()` does not (measured:
    SIGTERM was lost this way in 3 of 8 runs). CPython's C-level handler
    also writes the signal number to the wakeup fd, from whichever thread, so
    the main thread blocks reading that fd.
    """

    _SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def install(self) -> None:
        """Must run in the main thread, before other threads start."""
        self._read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # set_wakeup_fd requires it.
        signal.set_wakeup_fd(write_fd)
        for sig in self._SIGNALS:
            # A Python handler must be installed for the wakeup fd to be written;
            # the work is done by wait().
            signal.signal(sig, lambda signum, frame: None)

    def watch_owner(self, task: str) -> None:
        """Exits the process when its parent (the owner that started it) is gone,
        even while the process is stopped (SIGSTOP) or the owner's children
        still hold the lifeline pipe.

        Linux sends the parent-death signal when the thread that started this
        process ends, or its whole process. SIGCONT is the one signal that
        both resumes a stopped process and can be handled; wait() then asks
        whether the parent process is still the same (when only a thread of it
        ended, it is: nothing happens). Must run in the main thread, first.
        """
        self._owner = os.getppid()
        self._task = task
        signal.signal(signal.SIGCONT, lambda signum, frame: None)  # The wakeup fd hears it.
        if not _set_parent_death_signal(signal.SIGCONT):
            return  # Not Linux: the lifeline pipe alone.
        if os.getppid() != self._owner:  # Gone between the two calls.
            _owner_gone(task)

    def wait(self, timeout: float | None = None) -> str | None:
        """Blocks until SIGTERM or SIGINT and returns its name, or None after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and (left <= 0 or not select.select([self._read_fd], [], [], left)[0]):
                return None
            for signum in os.read(self._read_fd, 64):
                if signum in self._SIGNALS:
                    return signal.Signals(signum).name
                if signum == signal.SIGCONT and getattr(self, "_owner", None) not in (None, os.getppid()):
                    _owner_gone(self._task)


def _set_parent_death_signal(sig: int) -> bool:
    """prctl(PR_SET_PDEATHSIG, sig) on Linux; False where there is no such call."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (AttributeError, OSError):
        return False
    return prctl(1, int(sig), 0, 0, 0) == 0  # 1 = PR_SET_PDEATHSIG


def _owner_gone(task: str) -> NoReturn:
    _log(f"psclient serve: {task} exiting: its parent process is gone")
    _exit(1)


def _exit_when_parent_dies(parent_fd: int, task: str) -> None:
    """Exits the process when the read end `parent_fd` of the parent's pipe sees EOF.

    Only the parent holds the write end and never writes to it (LocalCluster
    closes it in children the parent forks), so EOF means the parent is gone,
    even if it was SIGKILLed. The thread lives as long as the process, which
    it ends itself. `_StopSignals.watch_owner` covers what a thread cannot: a
    stopped process, and a pipe end kept open by another process.
    """

    def watch() -> None:
        try:
            os.read(parent_fd, 1)
        except OSError:
            pass  # A broken pipe also means the parent is gone.
        _owner_gone(task)

    threading.Thread(target=watch, name="psclient-parent-watch", daemon=True).start()


def context_threads(pid: int | str = "self") -> int:
    """How many TF eager-context inter-op threads process `pid` runs (from /proc).

    TF names each context's inter-op pool "Compute"; its threads are
    "tf_Compute" (tests/ops/test_serve_recycle.py checks that a coordinator leaves some).
    """
    count = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm", encoding="utf-8", errors="replace") as f:
                count += f.read().strip() == "tf_Compute"
        except OSError:
            continue  # The thread ended meanwhile.
    return count


def read_task_load(port: int) -> TaskLoad:
    """Connections to `port` and this process's TF context threads, from /proc."""
    return TaskLoad(connections=exposure.connections_to(port), context_threads=context_threads())


def restart_in_place(argv: Sequence[str], keep_fds: Sequence[int]) -> None:
    """Replaces this process with `argv` (same pid); returns only if that fails.

    Only stdin/stdout/stderr and `keep_fds` pass to the new program: every
    other descriptor (TF's listening socket above all) is marked close-on-exec,
    so the new server binds the port afresh and nothing of the old one stays.
    """
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep_fds:
            try:
                os.set_inheritable(fd, False)
            except OSError:
                continue  # Closed meanwhile (the listing's own fd, too).
    for fd in keep_fds:
        os.set_inheritable(fd, True)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(argv[0], list(argv))


def _serve_until_stopped(stop: _StopSignals, task: str, port: int, recycle_when_idle: float | None,
                         restart_argv: Sequence[str] | None, keep_fds: Sequence[int]) -> str:
    """Waits for SIGTERM/SIGINT (returns its name); with `recycle_when_idle`,
    restarts the process in place whenever IdleRecycler says so."""
    if recycle_when_idle is None:
        return stop.wait()
    recycler = IdleRecycler(recycle_when_idle, read_task_load(port), time.monotonic())
    while True:
        signal_name = stop.wait(timeout=1.0)
        if signal_name is not None:
            return signal_name
        load = read_task_load(port)
        now = time.monotonic()
        if not recycler.observe(load, now):
            continue
        _log(f"psclient serve: {task} restarting itself in place (same pid and port): no connection "
             f"for {recycler.idle_for(now):.0f} s, and it holds {recycler.leftover_threads(load)} "
             "threads of gone coordinators' contexts that TensorFlow does not release")
        try:
            restart_in_place(restart_argv, keep_fds)
        except OSError as e:
            _log(f"psclient serve: error: {task} could not restart itself ({e}); it goes on "
                 "serving without --recycle-when-idle")
            return stop.wait()


def _signal_ready(ready_fd: int) -> None:
    try:
        os.write(ready_fd, b"ready\n")
    finally:
        os.close(ready_fd)


# TensorFlow's `__init__` imports `keras.src.optimizers` eagerly (for Keras's
# SavedModel registrations) and goes on without it on ImportError (TF 2.16 to
# 2.21 alike). A task server only runs the functions coordinators send it and
# never Keras code, yet that import (all of Keras, IPython and scikit-learn
# behind it) was about 1.5 of the 4 CPU seconds each task start took.
_KERAS_AT_TF_IMPORT = "keras.src.optimizers"


def _import_tensorflow():
    """`import tensorflow`, skipping the Keras import made by TensorFlow's own
    import; Keras stays importable in this process afterwards."""
    blocked = _KERAS_AT_TF_IMPORT not in sys.modules
    if blocked:
        sys.modules[_KERAS_AT_TF_IMPORT] = None  # makes that import raise ImportError
    try:
        # Here, not at the top: serve sets GRPC_FAIL_FAST first, and blocks Keras's import.
        import tensorflow as tf
    finally:
        if blocked and sys.modules.get(_KERAS_AT_TF_IMPORT, "") is None:
            del sys.modules[_KERAS_AT_TF_IMPORT]
    return tf


def _start_server(tf: Any, cluster: Cluster, job: str, index: int, inter_op_threads: int):
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=inter_op_threads)
    return tf.distribute.Server(
        # Without the evaluator: an evaluator in the spec makes training hang.
        tf.train.ClusterSpec(cluster.training_spec()),
        job_name=job,
        task_index=index,
        protocol="grpc",
        config=config,
        start=True,
    )


def _peers_or_exit(cluster: Cluster, task: str, port: int, later: Sequence[str],
                   peers_file: str | None) -> Peers:
    """The task's peers, resolved; exits 1 (before TensorFlow starts) when the
    port could not be closed to everyone else."""
    cannot = f"psclient serve: error: cannot start {task} closed to other hosts"
    if not exposure.supported():
        _log(f"{cannot}: socket filters need Linux (this is {sys.platform}). Pass --allow-any-host "
             "to run it with its port open to every host that reaches it.")
        _exit(1)
    if cluster.chief is None:
        _log(f"{cannot}: the cluster names no coordinator, so its host would be shut out. Add a "
             "\"chief\" job with the coordinator's address to the cluster, or pass --allow-any-host "
             "to leave the port open to every host.")
        _exit(1)
    peers = Peers(cluster_hosts(cluster), port, what=task, later=later, path=peers_file,
                  say=lambda line: _log(f"psclient serve: {line}"))
    try:
        peers.start()
    except (exposure.PortExposedError, ValueError) as e:  # ClusterConfigError: a bad peers file
        _log(f"{cannot}: {e}")
        _exit(1)
    return peers


def serve(
    cluster: Cluster,
    job: str,
    index: int,
    *,
    inter_op_threads: int | None = None,
    ready_fd: int | None = None,
    parent_fd: int | None = None,
    allow_any_host: bool = False,
    peer_hosts_later: Sequence[str] = (),
    peers_file: str | None = None,
    recycle_when_idle: float | None = None,
    restart_argv: Sequence[str] | None = None,
) -> NoReturn:
    """Runs task `job:index` of `cluster` until SIGTERM or SIGINT, then exits 0.

    Must be called from the main thread (it installs signal handlers); never
    returns. Exits with status 1 if the server cannot start.

    Args:
        cluster: the cluster; the task serves the address `cluster.address(job, index)`.
        job: "worker" or "ps".
        index: the task's index in its job.
        inter_op_threads: TensorFlow inter-op threads; at least 2, by default
            `default_inter_op_threads(cluster)`.
        ready_fd: a pipe's write end; "ready\\n" is written to it, and it is
            closed, once the server has started.
        parent_fd: the read end of a pipe whose write end only the parent holds;
            its EOF (the parent died) ends the task. Also arms Linux's
            parent-death signal, which ends the task if its parent process is
            gone (even while the task is stopped).
        allow_any_host: leave the task's port open to every host that reaches
            it (a warning says so). By default the port drops every packet that
            comes neither over loopback nor from an address of the cluster's
            hosts (every job but "evaluator"), before saying "ready"; the task
            exits 1 if that cannot be done: the cluster names no "chief" (the
            coordinator, which would be shut out), a host does not resolve, not
            Linux, or a stranger got in first (see `exposure.restrict_port`).
            Names are resolved again while the task runs (see peers.py).
        peer_hosts_later: hosts admitted too, once they resolve (`--peer-hosts`:
            Kubernetes pods, which may not exist yet when this one starts).
        peers_file: a JSON cluster file whose hosts are admitted too, read again
            whenever it changes (workers that join from other hosts; see
            peers.py); exit 1 if it is unreadable at start.
        recycle_when_idle: seconds; once the task holds what gone coordinators'
            contexts left (TF keeps some for good) and no connection has been
            open to its port that long, the process replaces itself with
            `restart_argv` (same pid; see psclient/_core/recycling.py). Linux only.
        restart_argv: the command that serves this task again (`psclient
            serve ...` without --ready-fd); required with `recycle_when_idle`.
    """
    if job not in SERVED_JOBS:
        raise ValueError(
            f"Invalid value for argument `job`. Received: job={job!r}. "
            f"Expected one of {list(SERVED_JOBS)}."
        )
    address = cluster.address(job, index)
    if inter_op_threads is None:
        inter_op_threads = default_inter_op_threads(cluster)
    check_inter_op_threads(inter_op_threads)
    task = f"{job}:{index}"
    if recycle_when_idle is not None:
        check_positive("recycle_when_idle", recycle_when_idle, unit="seconds")
        if restart_argv is None:
            raise ValueError("Invalid value for argument `restart_argv`. Received: None. Expected "
                             "the command that serves this task again, with `recycle_when_idle`.")
        if not os.path.isdir("/proc/self/task"):
            _log(f"psclient serve: error: cannot start {task} with --recycle-when-idle: it reads "
                 "/proc, which this system lacks (Linux only)")
            _exit(1)
    problem = local_address_problem(address)
    if problem is not None:  # TF would start, say nothing, and serve nobody
        _log(f"psclient serve: error: cannot start {task} at {address}: {problem}")
        _exit(1)

    # Failures of other tasks must reach callers as errors instead of being
    # retried forever inside gRPC. Set before TensorFlow is imported.
    os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
    stop = _StopSignals()
    stop.install()
    if parent_fd is not None:
        stop.watch_owner(task)
        _exit_when_parent_dies(parent_fd, task)
    port = int(address.rsplit(":", 1)[1])
    peers = None if allow_any_host else _peers_or_exit(cluster, task, port, peer_hosts_later, peers_file)
    if peers is None:
        _log(f"psclient serve: {ANY_HOST_WARNING}")
    tf = _import_tensorflow()  # Lazily, and only after GRPC_FAIL_FAST is set.

    try:
        server = _start_server(tf, cluster, job, index, inter_op_threads)
    except (tf.errors.OpError, ValueError) as e:  # UnknownError for a port in use; a bad spec.
        _log(f"psclient serve: error: cannot start {task} at {address}: {e}")
        _exit(1)
    if peers is not None:
        try:
            peers.restrict(peers.wanted())
        except exposure.PortExposedError as e:
            _log(f"psclient serve: error: {e}")
            _exit(1)
        peers.watch(on_error=lambda e: (_log(f"psclient serve: error: {e}"), _exit(1)))
        _log("psclient serve: " + RESTRICTED_WARNING.format(peers=", ".join(sorted(str(p) for p in peers.peers))))
    _log(f"psclient serve: {task} ready at {address} (pid {os.getpid()})")
    if ready_fd is not None:
        _signal_ready(ready_fd)
    keep_fds = () if parent_fd is None else (parent_fd,)
    signal_name = _serve_until_stopped(stop, task, port, recycle_when_idle,
                                       restart_argv, keep_fds)
    _log(f"psclient serve: {task} stopping on {signal_name}")
    if peers is not None:
        peers.stop(timeout=10.0)  # at most one resolution round in progress
    del server
    _exit(0)
