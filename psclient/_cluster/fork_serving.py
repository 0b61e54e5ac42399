"""The fork server's own side (`psclient serve --fork-server FD`): import TensorFlow, then fork tasks.

What a `LocalCluster` asks of it and why: forkserver.py. Each request (one
message on the control socket, with the task's two pipe ends passed along)
names the task's `psclient serve` options, environment and log; the server
forks a child that becomes that task and answers with its pid, then reports
its exit status once it has reaped it. It exits when the control socket
closes (its owner closed it, or died) or after `IDLE_EXIT_S` without a task.
"""

from __future__ import annotations

import json
import os
import select
import shlex
import signal
import socket
import sys
import time
import traceback
from typing import Callable

try:
    import setproctitle as _title
except ImportError:  # a platform without its wheel: `ps` shows the server's command for each task
    _title = None

__all__ = ["IDLE_EXIT_S", "MESSAGE_BYTES", "OPTION", "serve_forks"]

#: A fork server with no task and no request for this long exits (its ~300 MB given back).
IDLE_EXIT_S = 120.0
#: The largest message either side sends (a request carries a task's environment).
MESSAGE_BYTES = 1 << 20
#: The option that makes `psclient serve` a fork server (hidden from --help).
OPTION = "--fork-server"


def serve_forks(control_fd: int, import_tensorflow: Callable[[], object], serve: Callable[[list[str]], int]) -> int:
    """Run as the fork server until the control socket closes or IDLE_EXIT_S pass without a task.

    `import_tensorflow()`: what every task imports, paid here once; `serve(options)`: a task's
    `psclient serve` with these options (returns its exit status)."""
    control = socket.socket(fileno=control_fd)
    import_tensorflow()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # the wakeup fd hears it
    children: set[int] = set()
    idle_since = time.monotonic()
    while True:
        timeout = None if children else max(0.0, idle_since + IDLE_EXIT_S - time.monotonic())
        readable = select.select([control, wake_r], [], [], timeout)[0]
        if not readable and not children:
            return 0  # idle: nobody needs the import any more
        if wake_r in readable:
            os.read(wake_r, 4096)
        for pid, code in _reaped(children):
            children.discard(pid)
            _send(control, {"exit": pid, "code": code})
            idle_since = time.monotonic()
        if control in readable:
            try:
                data, fds, _, _ = socket.recv_fds(control, MESSAGE_BYTES, 8)
            except OSError:
                data, fds = b"", []
            if not data:
                return 0  # the coordinator closed its end, or is gone: so are its tasks
            request = json.loads(data)
            try:
                pid = _fork_task(request, fds, control, (wake_r, wake_w), serve)
            except OSError as error:
                _send(control, {"id": request["id"], "error": str(error)})
            else:
                children.add(pid)
                _send(control, {"id": request["id"], "pid": pid})
            finally:
                for fd in fds:
                    os.close(fd)
            idle_since = time.monotonic()


def _reaped(children: set[int]) -> list[tuple[int, int]]:
    done = []
    for pid in list(children):
        try:
            reaped, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done.append((pid, -1))
            continue
        if reaped:
            done.append((pid, os.waitstatus_to_exitcode(status)))
    return done


def _send(control: socket.socket, message: dict) -> None:
    try:
        control.send(json.dumps(message).encode())
    except OSError:
        pass  # the coordinator is gone: the next read sees EOF


def _fork_task(request: dict, fds: list[int], control: socket.socket, server_fds: tuple[int, ...],
               serve: Callable[[list[str]], int]) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:  # the child: never returns into the server's loop
        control.close()
        code = _become_task(request, fds, server_fds, serve)
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:  # noqa: BLE001 - the task's log says why, the status says it failed
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
    return 0  # unreachable


def _become_task(request: dict, fds: list[int], server_fds: tuple[int, ...], serve: Callable[[list[str]], int]) -> int:
    os.setsid()  # own session: a terminal's Ctrl-C reaches the coordinator only
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in server_fds:
        os.close(fd)
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    argv = list(request["argv"])
    for option, fd in zip(request["fd_options"], fds):
        argv += [option, str(fd)]
    if _title is not None:  # what `ps` and `pgrep -f` show: this task's own command, not the server's
        # Before the environment is replaced: setproctitle finds the room it writes in beside it.
        _title.setproctitle(shlex.join([sys.executable, "-m", "psclient", "serve", *argv]))
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [sys.argv[0], "serve", *argv]
    return serve(argv)
