"""Hosts on one network, made of Linux network namespaces, for tests of what reaches a task's port.

`Network` makes a namespace holding a bridge (the "switch") and, per host, a
namespace joined to it by a veth pair, with one IPv4 address on a private
/24. Nothing is made or changed in the test process's own namespace; traffic
goes only between the namespaces made here. `close()` deletes them (their
veths go with them) and the /etc/netns/<name> directories made for their
/etc/hosts (`ip netns exec` mounts /etc/netns/<name>/hosts on /etc/hosts for
the commands it runs). Needs root and `ip`.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time

PREFIX = "psc-hosts-"

# Each target on a thread of its own: a dropped connection waits out its timeout.
_PROBE = """
import json, socket, sys, threading
results = {}
def attempt(host, port):
    with socket.socket() as s:
        s.settimeout(1.5)
        try:
            s.connect((host, port))
            results[f"{host}:{port}"] = "connected"
        except OSError as e:
            results[f"{host}:{port}"] = type(e).__name__
threads = [threading.Thread(target=attempt, args=tuple(t)) for t in json.loads(sys.argv[1])]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps(results))
"""


def usable() -> str | None:
    """Why these tests cannot run here, or None."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0 or shutil.which("ip") is None:
        return (f"needs Linux, root and the `ip` command to make network namespaces (platform {sys.platform}, "
                f"euid {os.geteuid()}, ip {shutil.which('ip')})")
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def remove_leftovers() -> None:
    """Namespaces of a run killed before its teardown (its pid is gone)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    for line in listed.splitlines()[:200]:
        name = line.split()[0] if line.split() else ""
        pid = name.removeprefix(PREFIX).split("-", 1)[0]
        if name.startswith(PREFIX) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)


class Network:
    """A switch and the hosts on it: `add(tag, last_octet)` returns the host's address."""

    def __init__(self) -> None:
        remove_leftovers()
        pid = os.getpid()
        self.subnet = f"10.214.{100 + pid % 100}"
        self._prefix = f"{PREFIX}{pid}-"
        self.switch = self._prefix + "sw"
        self.namespaces: dict[str, str] = {}  # tag -> namespace
        self.addresses: dict[str, str] = {}  # tag -> IPv4 address
        self._made = [self.switch]
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")

    def add(self, tag: str, octet: int) -> str:
        namespace, port = self._prefix + tag, f"p{octet}"
        address = f"{self.subnet}.{octet}"
        self._made.append(namespace)
        _ip("netns", "add", namespace)
        os.makedirs(f"/etc/netns/{namespace}", exist_ok=True)
        self.write_hosts(tag, {})
        _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", namespace)
        _ip("-n", self.switch, "link", "set", port, "master", "br0")
        _ip("-n", self.switch, "link", "set", port, "up")
        _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", namespace, "link", "set", "eth0", "up")
        _ip("-n", namespace, "link", "set", "lo", "up")
        self.namespaces[tag], self.addresses[tag] = namespace, address
        return address

    def write_hosts(self, tag: str, names: dict[str, str]) -> None:
        """The /etc/hosts that commands run on host `tag` see (name -> address), rewritten in place:
        `ip netns exec` bind-mounts this very file, so it must stay the same inode."""
        lines = ["127.0.0.1 localhost", *(f"{address} {name}" for name, address in names.items())]
        path = f"/etc/netns/{self._prefix + tag}/hosts"
        with open(path, "a+", encoding="ascii") as f:
            f.seek(0)
            f.truncate()
            f.write("\n".join(lines) + "\n")

    def command(self, tag: str, argv: list[str]) -> list[str]:
        """`argv`, run on host `tag`."""
        return ["ip", "netns", "exec", self.namespaces[tag], *argv]

    def probe(self, tag: str, targets: list[tuple[str, int]]) -> dict[str, str]:
        """{"host:port": "connected" or the error's name}, each tried once from host `tag`."""
        out = subprocess.run(self.command(tag, [sys.executable, "-c", _PROBE, json.dumps(targets)]),
                             check=True, capture_output=True, text=True, timeout=120)
        return json.loads(out.stdout)

    def close(self) -> None:
        for namespace in reversed(self._made):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
            shutil.rmtree(f"/etc/netns/{namespace}", ignore_errors=True)


class Lines:
    """A child's output lines, read by a thread into a queue (joined at close)."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.lines: queue.Queue = queue.Queue()
        self.seen: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(process.stdout,))
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, text: str, timeout: float) -> str:
        """The first line from now on that contains `text`; AssertionError at EOF or after `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                raise AssertionError(f"no line with {text!r} within {timeout} s (or the process ended); "
                                     f"output:\n{''.join(self.seen[-60:])}")
            self.seen.append(line)
            if text in line:
                return line

    def close(self) -> None:
        self._thread.join(timeout=60)


class Children:
    """Processes started in their own session; `close()` interrupts, then kills, what is left."""

    def __init__(self, env: dict[str, str], cwd: str) -> None:
        self._env, self._cwd = env, cwd
        self._started: list[tuple[subprocess.Popen, Lines]] = []

    def start(self, argv: list[str], *, stdin: bool = False) -> tuple[subprocess.Popen, Lines]:
        process = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   start_new_session=True, cwd=self._cwd, env=self._env)
        lines = Lines(process)
        self._started.append((process, lines))
        return process, lines

    def close(self) -> None:
        for process, _ in self._started:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process, lines in self._started:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)
            lines.close()
            process.stdout.close()
            if process.stdin is not None:
                process.stdin.close()
