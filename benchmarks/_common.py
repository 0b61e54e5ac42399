"""Shared parts of psclient's benchmarks: clusters, coordinator subprocesses, output.

A benchmark is one parent process that starts a `psclient.LocalCluster` and
then runs each measured path in its own coordinator subprocess (TensorFlow's
eager context is process-global, so one process can hold one coordinator
connection). The parent collects one JSON line from each child and prints one
JSON object on stdout; progress goes to stderr.

Ownership: the parent owns the cluster and every child. A child watches its
stdin, a pipe only the parent holds, and exits as soon as it sees EOF, so a
parent that dies in any way (even SIGKILL) takes its children with it; the
task processes of `LocalCluster` do the same on their own.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Iterator, Sequence

__all__ = [
    "ChildError",
    "child_exit",
    "cpu_seconds",
    "environment",
    "LoopbackBytes",
    "exit_with_parent",
    "Heartbeat",
    "local_cluster",
    "log",
    "machine_busy_seconds",
    "median",
    "print_json",
    "quiet_tf_env",
    "run_child",
    "run_parent",
    "stop_on_sigterm",
    "task_usage",
]


# ----------------------------------------------------------------- output
def log(message: str) -> None:
    """A progress line on stderr, timestamped."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def print_json(obj: Any, also_to: str | None = None) -> None:
    """Prints `obj` as JSON; with `also_to`, also writes it to that file
    (through a temporary file beside it, renamed into place)."""
    json.dump(obj, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")
    sys.stdout.flush()
    if also_to:
        directory = os.path.dirname(os.path.abspath(also_to))
        with tempfile.NamedTemporaryFile("w", dir=directory, prefix=".tmp-", suffix=".json",
                                         delete=False) as f:
            json.dump(obj, f, indent=2)
        os.replace(f.name, also_to)


def require_tf_keras(parser: Any, needed: bool, what: str) -> None:
    """Stop with a clear message, before any cluster starts, when `what` (an anchor on tf_keras)
    was asked for and tf_keras is not installed: otherwise every run of that anchor fails late."""
    import importlib.util

    if needed and importlib.util.find_spec("tf_keras") is None:
        parser.error(f"{what} needs tf_keras (the anchors' Keras 2), which is not installed: "
                     'pip install -e ".[benchmarks]", or leave that anchor out.')


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def environment(argv: Sequence[str]) -> dict:
    """Versions, machine and command line, for a benchmark's `config`."""
    import importlib.metadata

    import psclient  # Cheap: it imports TensorFlow lazily, as do we here.

    def version(package: str) -> str | None:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    try:
        usable_cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable_cpus = os.cpu_count()
    return {
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *argv]),
        **_git_state(),
        "python": platform.python_version(),
        **{name: version(name) for name in ("tensorflow", "keras", "tf-keras", "numpy", "psutil")},
        "psclient": psclient.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable_cpus,
    }


def _git_state() -> dict:
    """The commit of the psclient being measured, and whether psclient/ differs from it."""
    import psclient

    root = os.path.dirname(os.path.dirname(os.path.abspath(psclient.__file__)))

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--", "psclient")
    return {"git_commit": commit, "psclient_uncommitted_changes": None if status is None else bool(status)}


# -------------------------------------------------------------- processes
def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds used so far by the processes `pids` together."""
    import psutil

    total = 0.0
    for pid in pids:
        times = psutil.Process(pid).cpu_times()
        total += times.user + times.system
    return total


def machine_busy_seconds() -> float:
    """CPU seconds all CPUs of this machine have spent busy (not idle) since boot."""
    import psutil

    times = psutil.cpu_times()
    return sum(getattr(times, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq"))


def task_usage(pids: Sequence[int]) -> dict:
    """Resident memory (MiB) and thread count of the processes `pids` together."""
    import psutil

    processes = [psutil.Process(pid) for pid in pids]
    return {
        "rss_mib": round(sum(p.memory_info().rss for p in processes) / 2**20, 1),
        "threads": sum(p.num_threads() for p in processes),
    }


@contextlib.contextmanager
def local_cluster(num_workers: int, num_ps: int, **options: Any) -> Iterator[tuple[Any, dict[str, int]]]:
    """A running `psclient.LocalCluster`: yields its `Cluster` and {"worker:0": pid, ...}.

    The cluster's tasks run in their own sessions, so a Ctrl-C reaches only
    the parent (and its coordinator children), whose `finally` then closes it.
    `options` go to LocalCluster (log_dir, recycle_when_idle, ...).
    """
    import psclient

    # Each task a process of its own, as on a real cluster (a restart pays TensorFlow's import, a
    # task's memory is its own), unless `options` say otherwise; benchmarks/cluster_start.py compares.
    with psclient.LocalCluster(num_workers=num_workers, num_ps=num_ps, **{"start_method": "spawn", **options}) as local:
        cluster = local.cluster
        pids = {f"{job}:{index}": local.pid(job, index) for job, index, _ in cluster.tasks()}
        yield cluster, pids


@contextlib.contextmanager
def keras_side_by_side(build_model: Callable[[], Any], num_workers: int, num_ps: int
                       ) -> Iterator[tuple[dict[str, Any], dict[str, list[int]]]]:
    """Two copies of `build_model()`'s model with the same weights: {"keras_local": one in this
    process, "psclient": one on a fresh local cluster (a strategy's scope)}, and the pids whose
    CPU each path spends (this process; for psclient the cluster's tasks too)."""
    import psclient

    with local_cluster(num_workers, num_ps) as (cluster, task_pids):
        strategy = psclient.ParameterServerStrategy(cluster)
        try:
            with strategy.scope():
                on_cluster = build_model()
            local = build_model()
            local.set_weights(on_cluster.get_weights())
            yield ({"keras_local": local, "psclient": on_cluster},
                   {"keras_local": [os.getpid()], "psclient": [os.getpid(), *task_pids.values()]})
        finally:
            strategy.shutdown()


def use_psclient_from(checkout: str | None) -> None:
    """Import psclient from `checkout` (another commit, timed in the same run conditions), in this
    process and in the task processes it starts; None: this checkout's."""
    if checkout:
        sys.path.insert(0, os.path.abspath(checkout))
        os.environ["PYTHONPATH"] = os.path.abspath(checkout) + os.pathsep + os.environ.get("PYTHONPATH", "")


def quiet_tf_env(**extra: str) -> dict[str, str]:
    """This environment, with TensorFlow's C++ info logs off, plus `extra`."""
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.update(extra)
    return env


class ChildError(RuntimeError):
    """A benchmark subprocess failed, timed out or printed no JSON result."""


def run_child(argv: Sequence[str], *, timeout: float, env: dict[str, str] | None = None) -> dict:
    """Runs `python argv...` and returns the JSON object on its last stdout line.

    The child's stdin is a pipe held open until it ends (see `exit_with_parent`).
    Raises `ChildError` (with the end of its stderr) if it exits non-zero, runs
    past `timeout` seconds, or prints no JSON. On any exception here, including
    KeyboardInterrupt, the child is killed and reaped before it propagates.
    """
    command = [sys.executable, *argv]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=out, stderr=err, env=env)
        try:
            try:
                rc = child.wait(timeout)
            except subprocess.TimeoutExpired:
                raise ChildError(
                    f"timed out after {timeout:.0f} s (killed): {_tail(err)}"
                ) from None
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
            child.stdin.close()
        if rc != 0:
            raise ChildError(f"exited with status {rc}: {_tail(err)}")
        out.seek(0)
        lines = [line for line in out.read().splitlines() if line.strip()]
        try:
            return json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            raise ChildError(f"printed no JSON result: {_tail(err)}") from None


def _tail(file, lines: int = 15) -> str:
    file.seek(0)
    text = "\n".join(file.read().splitlines()[-lines:])
    return f"stderr ends with:\n{text}" if text else "stderr is empty"


def exit_with_parent() -> None:
    """In a child of `run_child`: exit at once when the parent closes our stdin."""

    def watch() -> None:
        try:
            while os.read(sys.stdin.fileno(), 4096):
                pass
        except OSError:
            pass
        os._exit(3)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def child_exit(result: dict | None, status: int = 0) -> None:
    """Prints a child's result (if any) as one JSON line and exits at once.

    `os._exit` skips TensorFlow's destructors, which can hang a normal exit of
    a process connected to a cluster.
    """
    if result is not None:
        sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """Turns SIGTERM into SystemExit(143), so `finally` blocks stop what we started."""

    def handle(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_parent(parent_main: Callable[[Any, list[str]], int], args: Any, script: str,
               argv: Sequence[str]) -> int:
    """Runs a benchmark's parent: `parent_main(args, command)`, `command` being
    `["benchmarks/<script's file name>", *argv]` (what `environment` records).

    Ctrl-C (KeyboardInterrupt) ends it with 130, the shell's status for SIGINT,
    and a line on stderr instead of a traceback: by the time the interrupt gets
    here, the parent's `with` and `finally` blocks have stopped its clusters,
    and `run_child` has killed and reaped the child it was waiting for.
    """
    try:
        return parent_main(args, [f"benchmarks/{os.path.basename(script)}", *argv])
    except KeyboardInterrupt:
        log("interrupted: the clusters and subprocesses it started were stopped")
        return 130


# ----------------------------------------------------------------- stalls
class Heartbeat:
    """A thread that ticks every 20 ms; `longest` is the longest gap between ticks:
    the longest time this process let none of its Python threads run.

    TF calls that block inside C++ with the GIL held stop every Python thread of
    the process, this one's too. Used as `with Heartbeat() as beat: ...`; the
    thread is stopped and joined on leaving the block. (tests/_heartbeat.py uses
    this one too.)
    """

    def __init__(self):
        self.longest = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def _run(self):
        last = time.monotonic()
        # Event.wait releases the GIL; a gap longer than the period means the
        # process did not let this thread run.
        while not self._stop.wait(0.02):
            now = time.monotonic()
            self.longest = max(self.longest, now - last)
            last = now

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)


# ------------------------------------------------------------ bytes moved
_SS_ADDRESS = re.compile(r"^(?P<host>.*):(?P<port>\d+)$")
_SS_PID = re.compile(r"pid=(\d+)")
_SS_COUNTER = re.compile(r"\b(bytes_sent|bytes_received|bytes_acked):(\d+)")


class LoopbackBytes:
    """TCP bytes moved between a cluster's processes, from the kernel's per-socket counters.

    Per-process network counters do not exist for loopback, so this reads what
    `ss -tinpe` prints for every TCP socket on the machine (`bytes_sent` and
    `bytes_received` of each socket, its owner's pid and inode) and keeps only
    the sockets that are the *server* end of a connection to one of the
    cluster's ports: every gRPC connection in the cluster is opened by some
    process to a task's (or the coordinator's) listening port, so counting
    server ends counts each connection once, and other processes' loopback
    traffic (a different port) is left out. The client end is looked up by its
    port to name the peer (coordinator, worker:i, ps:j or "other").

    The bytes are TCP payload: tensors plus gRPC/HTTP2 framing and protobuf
    headers, including health probes and keep-alives during the window.

        meter = LoopbackBytes({"chief": ["127.0.0.1:1234"], "worker": [...], "ps": [...]},
                              coordinator_pid=os.getpid())
        before = meter.snapshot()
        ... the measured steps ...
        per_step = meter.per_step(before, meter.snapshot(), steps)

    Caveats, reported in the result: a connection closed during the window
    takes its counters with it (counted as "closed_connections", its bytes
    lost); one opened during the window counts from zero. If `ss` is missing,
    `per_step` is {"total": None, "reason": ...}: never a made-up number.
    """

    def __init__(self, jobs: dict[str, Sequence[str]], *, coordinator_pid: int | None = None,
                 task_pids: dict[str, int] | None = None):
        self.ports: dict[int, str] = {}  # listening port -> "worker:0", "ps:1", "coordinator"
        for job, addresses in jobs.items():
            for index, address in enumerate(addresses):
                name = "coordinator" if job == "chief" else f"{job}:{index}"
                self.ports[int(address.rsplit(":", 1)[1])] = name
        self.pid_names: dict[int, str] = {pid: name for name, pid in (task_pids or {}).items()}
        if coordinator_pid is not None:
            self.pid_names[coordinator_pid] = "coordinator"
        self.ss = shutil.which("ss")
        self.unavailable: str | None = None if self.ss else "the `ss` command (iproute2) is not installed"

    def snapshot(self) -> dict | None:
        """{(inode, local_port, peer_port): (owner name, bytes_sent, bytes_received)} of cluster sockets."""
        if self.unavailable:
            return None
        try:
            text = subprocess.run([self.ss, "-tinpeH", "state", "established"], capture_output=True,
                                  text=True, timeout=20, check=True).stdout
        except (OSError, subprocess.SubprocessError) as error:
            self.unavailable = f"`ss -tinpe` failed: {error}"
            return None
        sockets = {}
        # A socket is one line of addresses, then an indented line of tcp_info.
        for head, info in zip(*[iter(_ss_records(text))] * 2):
            fields = head.split()
            addresses = [f for f in fields if _SS_ADDRESS.match(f) and not f.startswith(("ino:", "uid:", "sk:"))]
            if len(addresses) < 2:
                continue
            local, peer = (int(_SS_ADDRESS.match(a)["port"]) for a in addresses[:2])
            if local not in self.ports and peer not in self.ports:
                continue
            counters = dict((k, int(v)) for k, v in _SS_COUNTER.findall(info))
            if "bytes_received" not in counters:
                self.unavailable = "this kernel's tcp_info has no bytes_received counter"
                return None
            inode = re.search(r"\bino:(\d+)", head)
            pid = _SS_PID.search(head)
            owner = self.pid_names.get(int(pid.group(1)), "other") if pid else "unknown"
            sent = counters.get("bytes_sent", counters.get("bytes_acked", 0))
            sockets[(inode.group(1) if inode else "", local, peer)] = (owner, sent, counters["bytes_received"])
        return sockets

    def per_step(self, before: dict | None, after: dict | None, steps: int) -> dict:
        """Bytes per step moved over the cluster's connections between two snapshots."""
        if before is None or after is None:
            return {"total": None, "reason": self.unavailable or "no snapshot"}
        # Client ends: their local port names the peer of a server end.
        client_owner = {local: owner for (_, local, _), (owner, _, _) in after.items()
                        if local not in self.ports}
        client_owner.update({local: owner for (_, local, _), (owner, _, _) in before.items()
                             if local not in self.ports and local not in client_owner})
        by_direction: dict[str, float] = {}
        total = 0
        for key, (_, sent, received) in after.items():
            _, local, peer = key
            if local not in self.ports:
                continue  # a client end: its bytes are counted at the server end
            _, sent0, received0 = before.get(key, ("", 0, 0))
            server, client = self.ports[local], client_owner.get(peer, "other")
            for source, target, count in ((client, server, received - received0),
                                          (server, client, sent - sent0)):
                if count:
                    name = f"{source} -> {target}"
                    by_direction[name] = by_direction.get(name, 0) + count
                    total += count
        closed = sum(1 for key in before if key not in after and key[1] in self.ports)
        by_role: dict[str, float] = {}
        for name, count in by_direction.items():
            source, target = (_role(part) for part in name.split(" -> "))
            key = f"{source} -> {target}"
            by_role[key] = by_role.get(key, 0) + count
        return {
            "total": round(total / steps),
            "by_role": {k: round(v / steps) for k, v in sorted(by_role.items())},
            "by_task": {k: round(v / steps) for k, v in sorted(by_direction.items())},
            "closed_connections": closed,
            "method": "TCP payload bytes (gRPC/HTTP2 framing included) of the server ends of "
                      "connections to the cluster's ports, from `ss -tinpe`",
        }


def _ss_records(text: str) -> list[str]:
    """`ss -i` output as alternating [address line, info line] (info lines are indented)."""
    records: list[str] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        if line[0].isspace() and records and len(records) % 2 == 1:
            records.append(line)
        elif not line[0].isspace():
            if len(records) % 2 == 1:
                records.append("")  # an address line without info
            records.append(line)
    if len(records) % 2 == 1:
        records.append("")
    return records


def _role(name: str) -> str:
    job = name.split(":", 1)[0]
    return "workers" if job == "worker" else job


class ProcessCPU:
    """CPU seconds (user + system) of named processes, read together with the machine's busy seconds.

    `pids` maps a name ("coordinator", "ps:0", "worker:1", ...) to a pid. `read()` takes a snapshot;
    `per_step(before, after, steps)` turns two into milliseconds of CPU per step by process, by role
    (the name before its ":"), and in all, beside the share of the CPUs' capacity over the wall time
    between the reads that these processes used and that every other process used ("other": other
    jobs on a shared machine), and the 1-minute load average at each read. benchmarks/step_cpu.py
    reads the same counters.
    """

    def __init__(self, pids: dict[str, int]):
        import psutil

        self._processes = {name: psutil.Process(pid) for name, pid in pids.items()}

    def read(self) -> dict:
        return {
            "wall": time.perf_counter(),
            "busy": machine_busy_seconds(),
            "load": os.getloadavg()[0],
            "cpu": {name: sum(p.cpu_times()[:2]) for name, p in self._processes.items()},
        }

    @staticmethod
    def per_step(before: dict, after: dict, steps: int) -> dict:
        used = {name: after["cpu"][name] - before["cpu"][name] for name in before["cpu"]}
        roles: dict[str, float] = {}
        for name, seconds in used.items():
            roles[name.split(":")[0]] = roles.get(name.split(":")[0], 0.0) + seconds
        wall = after["wall"] - before["wall"]
        capacity = wall * (os.cpu_count() or 1)
        other = (after["busy"] - before["busy"]) - sum(used.values())
        ms = lambda seconds: round(1000 * seconds / steps, 2)  # noqa: E731
        return {
            "cpu_ms_per_step": {"by_process": {n: ms(s) for n, s in used.items()},
                                "by_role": {r: ms(s) for r, s in roles.items()}, "all": ms(sum(used.values()))},
            "measured_cpu_share": round(sum(used.values()) / capacity, 3),
            "other_processes_cpu_share": round(max(0.0, other) / capacity, 3),
            "load_average_1min": {"before": round(before["load"], 2), "after": round(after["load"], 2)},
        }
