"""Nothing psclient starts is reachable from another host: measured from a second "host".

The test makes a network namespace joined to this one by a veth pair (its own
addresses on a private subnet, IPv4 and IPv6) and, from inside it, opens a TCP
connection to every port of a LocalCluster and its coordinator (this process),
of `psclient launch` (tasks and the script's coordinator) and of
`psclient demo`: every attempt must fail, while training inside goes on. A
plain listener beside them shows that the probe does reach this host.
`psclient serve` (closed by default) lets a cluster peer in and nobody else;
tests/ops/test_serve_hosts.py runs it on several hosts.
Needs root and `ip`; the namespace and the veth are removed afterwards.
Traffic goes only to loopback and to the namespace made here.
"""

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

from _paths import ROOT_STR

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

if not sys.platform.startswith("linux") or os.geteuid() != 0 or shutil.which("ip") is None:
    pytest.skip("needs Linux, root and the `ip` command to make a network namespace and a veth pair "
                f"(platform {sys.platform}, euid {os.geteuid()}, ip {shutil.which('ip')})",
                allow_module_level=True)

_SUBNET = 200 + os.getpid() % 50  # 10.213.<_SUBNET>.0/24: private, and apart per test run.
HOST_V4, PEER_V4, STRANGER_V4 = (f"10.213.{_SUBNET}.{i}" for i in (1, 2, 3))
HOST_V6, OTHER_V6 = f"fd00:213:{_SUBNET}::1", f"fd00:213:{_SUBNET}::2"

# Each target on a thread of its own: a dropped connection waits out its 1.5 s
# timeout, and one after another they made up most of this module's time.
_PROBE = """
import json, socket, sys, threading
results = {}
def attempt(source, host, port):
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(1.5)
        try:
            s.bind((source, 0))
            s.connect((host, port))
            results[f"{source}->{host}:{port}"] = "connected"
        except OSError as e:
            results[f"{source}->{host}:{port}"] = type(e).__name__
threads = [threading.Thread(target=attempt, args=tuple(t)) for t in json.loads(sys.argv[1])]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps(results))
"""


def _ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _remove_leftovers():
    """Namespaces of this test left by a run that was killed before its
    teardown (their veth pair goes with them): same subnets, so they would
    confuse this run's routes."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    for line in listed.splitlines()[:100]:
        name = line.split()[0] if line.split() else ""
        pid = name.removeprefix("psc-exp-")
        if name.startswith("psc-exp-") and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def other_host(request):
    """The namespace's name; it and the veth pair go at teardown, also after a failure."""
    name, host_if, ns_if = f"psc-exp-{os.getpid()}", f"pse{os.getpid()}h", f"pse{os.getpid()}n"

    def remove():
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)

    request.addfinalizer(remove)
    _remove_leftovers()
    _ip("netns", "add", name)
    _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
    _ip("link", "set", ns_if, "netns", name)
    _ip("addr", "add", f"{HOST_V4}/24", "dev", host_if)
    _ip("-6", "addr", "add", f"{HOST_V6}/64", "dev", host_if, "nodad")
    _ip("link", "set", host_if, "up")
    for address in (f"{PEER_V4}/24", f"{STRANGER_V4}/24"):
        _ip("-n", name, "addr", "add", address, "dev", ns_if)
    _ip("-n", name, "-6", "addr", "add", f"{OTHER_V6}/64", "dev", ns_if, "nodad")
    _ip("-n", name, "link", "set", ns_if, "up")
    _ip("-n", name, "link", "set", "lo", "up")
    return name


def probe(namespace, targets):
    """{"source->host:port": "connected" or the error's name} for each (source, host, port)."""
    out = subprocess.run(["ip", "netns", "exec", namespace, sys.executable, "-c", _PROBE, json.dumps(targets)],
                         check=True, capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout)


def probe_ports(namespace, ports):
    """Every port, from the other host, over IPv4 and IPv6; plus a plain listener here as control."""
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as control:
        control.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        control.bind(("::", 0))
        control.listen()
        control_port = control.getsockname()[1]
        targets = [[source, host, port] for port in [*ports, control_port]
                   for source, host in ((STRANGER_V4, HOST_V4), (OTHER_V6, HOST_V6))]
        results = probe(namespace, targets)
    control_results = {k: v for k, v in results.items() if k.endswith(f":{control_port}")}
    assert set(control_results.values()) == {"connected"}, control_results  # The probe reaches this host.
    reached = {k: v for k, v in results.items() if v == "connected" and k not in control_results}
    assert len(results) == 2 * (len(ports) + 1)
    return reached


def listening_ports(pid):
    """TCP ports that the process and its descendants listen on."""
    ports = set()
    root = psutil.Process(pid)
    for process in [root, *root.children(recursive=True)]:
        try:
            ports |= {c.laddr.port for c in process.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
        except psutil.NoSuchProcess:
            continue
    return ports


class _Lines:
    """A child's output lines, read by a thread into a queue (joined at close)."""

    def __init__(self, process):
        self.lines = queue.Queue()
        self.seen = []
        self._thread = threading.Thread(target=self._read, args=(process.stdout,))
        self._thread.start()

    def _read(self, stream):
        for line in stream:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, text, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            self.seen.append(line)
            if text in line:
                return line
        pytest.fail(f"no line with {text!r} within {timeout} s; output:\n{''.join(self.seen[-40:])}")

    def close(self):
        self._thread.join(timeout=60)


@pytest.fixture
def run_child():
    """Starts commands in their own session; teardown kills what is left and joins the readers."""
    started = []

    def start(argv, **kwargs):
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, start_new_session=True, cwd=ROOT_STR, **kwargs)
        lines = _Lines(process)
        started.append((process, lines))
        return process, lines

    yield start
    for process, lines in started:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)
        lines.close()
        process.stdout.close()


def test_local_cluster_and_its_coordinator_are_closed_to_another_host(other_host, local_cluster, strategy):
    import tensorflow as tf

    with strategy.scope():
        v = tf.Variable(0.0)

    @tf.function
    def step():
        v.assign_add(1.0)
        return v.read_value()

    ports = [int(a.rsplit(":", 1)[1]) for _, _, a in local_cluster.cluster.tasks()]
    # The coordinator's server is started once per process, at its first
    # connection (an earlier test module's cluster, when run in one session).
    from psclient._coordinator import connection
    chief = int(connection._coordinator_address.rsplit(":", 1)[1])  # noqa: SLF001
    strategy.schedule(step).result(timeout=120)  # Connected and trained once.
    assert chief in listening_ports(os.getpid())  # The coordinator's own server.
    assert probe_ports(other_host, [*ports, chief]) == {}
    for _ in range(5):
        strategy.schedule(step)
    strategy.join()
    assert float(v.numpy()) == 6.0  # Training inside goes on.


_SCRIPT = """
import os, sys, time
import tensorflow as tf
import psclient
strategy = psclient.ParameterServerStrategy(psclient.Cluster.from_env())
with strategy.scope():
    v = tf.Variable(0.0)
@tf.function
def step():
    v.assign_add(1.0)
    return v.read_value()
for _ in range(4):
    strategy.schedule(step)
strategy.join()
print("TRAINED", float(v.numpy()), flush=True)
deadline = time.monotonic() + 240
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.1)
strategy.schedule(step).result(timeout=60)
print("TRAINED AGAIN", float(v.numpy()), flush=True)
strategy.shutdown()
"""


def test_psclient_launch_is_closed_to_another_host(other_host, run_child, tmp_path):
    script, go_on = tmp_path / "train.py", tmp_path / "go-on"
    script.write_text(_SCRIPT)
    process, lines = run_child([sys.executable, "-m", "psclient", "launch", "--workers", "2", "--ps", "1",
                                "--", sys.executable, str(script), str(go_on)])
    assert "TRAINED 4.0" in lines.wait_for("TRAINED", timeout=240)
    ports = listening_ports(process.pid)
    assert len(ports) == 4, ports  # 2 workers, 1 ps, and the script's coordinator.
    assert probe_ports(other_host, sorted(ports)) == {}
    go_on.touch()
    assert "TRAINED AGAIN 5.0" in lines.wait_for("TRAINED AGAIN", timeout=120)
    assert process.wait(timeout=120) == 0


def test_psclient_demo_is_closed_to_another_host(other_host, run_child, tmp_path):
    pytest.importorskip("sklearn", reason="psclient demo needs scikit-learn")
    process, lines = run_child([sys.executable, "-m", "psclient", "demo", "--epochs", "400",
                                "--workdir", str(tmp_path)])
    lines.wait_for("Epoch 2/400", timeout=240)  # The cluster is up and training.
    ports = listening_ports(process.pid)
    assert len(ports) == 4, ports  # 2 workers, 1 ps, and the demo's own coordinator.
    assert probe_ports(other_host, sorted(ports)) == {}
    lines.wait_for("Epoch 4/400", timeout=120)  # Still training.
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=120) == 130  # "interrupted; everything it started is stopped"


def test_serve_lets_only_the_cluster_in_by_default(other_host, run_child, tmp_path):
    with socket.socket() as s:  # A free port on this host.
        s.bind(("0.0.0.0", 0))
        port = s.getsockname()[1]
    cluster = {"worker": [f"{HOST_V4}:{port}"], "ps": ["127.0.0.1:1"], "chief": [f"{PEER_V4}:2"]}
    (tmp_path / "cluster.json").write_text(json.dumps(cluster))
    process, lines = run_child([sys.executable, "-m", "psclient", "serve", "--job", "worker", "--index", "0",
                                "--cluster", str(tmp_path / "cluster.json")])
    warning = lines.wait_for("drops every packet", timeout=120)
    assert f"from the cluster's own hosts ({HOST_V4}, {PEER_V4}, 127.0.0.1)" in warning
    lines.wait_for("ready at", timeout=60)
    results = probe(other_host, [[PEER_V4, HOST_V4, port], [STRANGER_V4, HOST_V4, port],
                                 [OTHER_V6, HOST_V6, port]])
    assert results == {f"{PEER_V4}->{HOST_V4}:{port}": "connected",
                       f"{STRANGER_V4}->{HOST_V4}:{port}": "TimeoutError",
                       f"{OTHER_V6}->{HOST_V6}:{port}": "TimeoutError"}
    with socket.create_connection(("127.0.0.1", port), timeout=10):  # This host: over loopback.
        pass
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0


def test_a_connection_that_got_in_before_the_filter_is_refused(other_host):
    from psclient._cluster import exposure

    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as listener:
        listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        listener.bind(("::", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert probe(other_host, [[STRANGER_V4, HOST_V4, port]]) == {f"{STRANGER_V4}->{HOST_V4}:{port}": "connected"}
        with pytest.raises(exposure.PortExposedError, match=rf"port {port} was reached from {STRANGER_V4}:\d+"):
            exposure.restrict_port(port, set(), what="the test's listener")


def test_serve_peers_file_admits_a_worker_host_that_joins_and_drops_it_when_it_leaves(
        other_host, run_child, tmp_path):
    with socket.socket() as s:  # A free port on this host.
        s.bind(("0.0.0.0", 0))
        port = s.getsockname()[1]
    cluster = {"worker": ["127.0.0.1:1"], "ps": [f"{HOST_V4}:{port}"], "chief": [f"{PEER_V4}:2"]}
    (tmp_path / "cluster.json").write_text(json.dumps(cluster))
    peers = tmp_path / "peers.json"
    peers.write_text(json.dumps({"cluster": cluster}))
    # --restrict-to-peers, the default's old name, is still accepted.
    process, lines = run_child([sys.executable, "-m", "psclient", "serve", "--job", "ps", "--index", "0",
                                "--cluster", str(tmp_path / "cluster.json"), "--restrict-to-peers",
                                "--peers-file", str(peers)])
    lines.wait_for("ready at", timeout=120)
    stranger = [[STRANGER_V4, HOST_V4, port]]
    assert probe(other_host, stranger) == {f"{STRANGER_V4}->{HOST_V4}:{port}": "TimeoutError"}
    # The operator adds a worker on the stranger's host: the ps task admits it, and nobody else.
    peers.write_text(json.dumps({"cluster": dict(cluster, worker=["127.0.0.1:1", f"{STRANGER_V4}:2222"])}))
    assert STRANGER_V4 in lines.wait_for("admits", timeout=60)
    results = probe(other_host, [*stranger, [OTHER_V6, HOST_V6, port]])
    assert results == {f"{STRANGER_V4}->{HOST_V4}:{port}": "connected",
                       f"{OTHER_V6}->{HOST_V6}:{port}": "TimeoutError"}
    # A half-written file changes nothing; then the worker leaves: its host is dropped again.
    peers.write_text('{"cluster": {')
    lines.wait_for("the peers in force stay", timeout=60)
    assert probe(other_host, stranger) == {f"{STRANGER_V4}->{HOST_V4}:{port}": "connected"}
    peers.write_text(json.dumps({"cluster": cluster}))
    assert STRANGER_V4 not in lines.wait_for("admits", timeout=60)
    assert probe(other_host, stranger) == {f"{STRANGER_V4}->{HOST_V4}:{port}": "TimeoutError"}
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0
