"""The peers a closed `psclient serve` task admits (peers.py), and how they change: a peers
file that changes, `--peer-hosts` that resolve late, names that move (no TensorFlow)."""

import ipaddress
import json
import socket
import subprocess
import sys

import pytest

from psclient._cluster import exposure
from psclient._cluster.peers import Peers, is_name

LOCAL = ipaddress.ip_address("127.0.0.1")


def ip(text):
    return ipaddress.ip_address(text)


def write(path, workers, ps=("127.0.0.1:2",)):
    path.write_text(json.dumps({"cluster": {"worker": list(workers), "ps": list(ps), "chief": ["127.0.0.1:3"]}}))


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, port, peers, *, what, lock, established_ok):
        self.calls.append((port, set(peers), what, lock, set(established_ok)))
        return 1


class FakeDns:
    """Names to addresses, changed by the test; a name it lacks does not resolve."""

    def __init__(self, table):
        self.table = dict(table)
        self.asked = []

    def __call__(self, hosts):
        (host,) = hosts
        self.asked.append(host)
        if host in self.table:
            return {ip(a) for a in self.table[host]}
        try:
            return {ip(host)}
        except ValueError:
            raise exposure.PortExposedError(f"cannot resolve the cluster host {host!r} (not known)") from None


def make_file_peers(tmp_path, lines):
    restrict = Recorder()
    path = tmp_path / "cluster.json"
    peers = Peers(["127.0.0.1"], 4444, what="ps:0", say=lines.append, path=path, restrict=restrict)
    return path, peers, restrict


def test_a_host_that_joins_the_file_is_admitted_and_one_that_leaves_is_dropped(tmp_path):
    lines = []
    path, peers, restrict = make_file_peers(tmp_path, lines)
    write(path, ["127.0.0.1:5"])
    assert peers.start() == {LOCAL}
    peers.restrict(peers.wanted())
    assert restrict.calls == [(4444, {LOCAL}, "ps:0", False, set())]  # not locked: the file may widen it
    assert peers.refresh(now=0) is False and len(restrict.calls) == 1  # nothing new
    write(path, ["127.0.0.1:5", "127.0.0.7:5"])
    assert peers.refresh(now=0) is True
    joined = ip("127.0.0.7")
    assert restrict.calls[-1] == (4444, {LOCAL, joined}, "ps:0", False, {LOCAL})
    assert peers.peers == {LOCAL, joined}
    assert "ps:0 admits 127.0.0.1, 127.0.0.7, and loopback" in lines[-1]
    write(path, ["127.0.0.1:5"])  # it left: new connections from it are dropped again
    assert peers.refresh(now=0) is True
    # The connections it made while admitted are no intrusion.
    assert restrict.calls[-1] == (4444, {LOCAL}, "ps:0", False, {LOCAL, joined})


@pytest.mark.parametrize("content, message", [
    (None, "Cannot read cluster file"),
    ("{", "is not valid JSON"),
    (json.dumps({"worker": ["no-such-host.invalid:1"], "ps": ["127.0.0.1:2"]}), "cannot resolve"),
])
def test_a_bad_file_is_said_once_and_the_peers_stay(tmp_path, content, message):
    lines = []
    path, peers, restrict = make_file_peers(tmp_path, lines)
    write(path, ["127.0.0.1:5"])
    peers.restrict(peers.start())
    if content is None:
        path.unlink()
    else:
        path.write_text(content)
    assert peers.refresh(now=0) is False and peers.refresh(now=0) is False
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0] and "the peers in force stay" in errors[0]
    assert len(restrict.calls) == 1 and peers.peers == {LOCAL}
    write(path, ["127.0.0.9:1"])
    assert peers.refresh(now=0) is True  # fixed: applied
    assert peers.peers == {LOCAL, ip("127.0.0.9")}


def test_a_cluster_of_addresses_alone_is_locked_and_never_watched():
    restrict = Recorder()
    peers = Peers(["10.0.0.1", "10.0.0.2"], 4444, what="ps:0", say=print, restrict=restrict)
    assert not peers.changing
    peers.restrict(peers.start())
    assert restrict.calls == [(4444, {ip("10.0.0.1"), ip("10.0.0.2")}, "ps:0", True, set())]
    assert peers.watch(on_error=print) is None  # no thread


def test_a_cluster_host_must_resolve_at_start():
    dns = FakeDns({})
    peers = Peers(["10.0.0.1", "typo.example"], 4444, what="ps:0", say=print, resolve=dns, restrict=Recorder())
    with pytest.raises(exposure.PortExposedError, match="typo.example"):
        peers.start()


def test_peer_hosts_that_do_not_resolve_yet_are_admitted_once_they_do():
    # Kubernetes: job-worker-1 has no pod yet; the chief's pod is scheduled later.
    dns = FakeDns({"job-ps-0.job": ["10.1.0.1"], "job-worker-0.job": ["10.1.0.2"]})
    lines, restrict = [], Recorder()
    hosts = ["job-chief-0.job", "job-ps-0.job", "job-worker-0.job"]
    peers = Peers(hosts, 4444, what="ps:0", say=lines.append, resolve=dns, restrict=restrict,
                  later=[*hosts, "job-worker-1.job"], resolve_every=5.0)
    assert peers.changing
    started = peers.start()
    assert started == {ip("10.1.0.1"), ip("10.1.0.2")}
    assert sorted(line.split(": ")[1].split()[0] for line in lines) == ["job-chief-0.job", "job-worker-1.job"]
    assert all("does not resolve yet; admitted once it does" in line for line in lines)
    peers.restrict(started)
    assert restrict.calls[-1][3] is False  # names: the filter is replaced as they resolve
    dns.table["job-chief-0.job"] = ["10.1.0.9"]
    assert peers.refresh(now=1e9) is True
    assert peers.peers == {ip("10.1.0.1"), ip("10.1.0.2"), ip("10.1.0.9")}
    assert peers.refresh(now=1e9 + 1) is False  # not due: nobody asked
    asked = len(dns.asked)
    assert peers.refresh(now=1e9 + 2) is False and len(dns.asked) == asked
    assert len([line for line in lines if "does not resolve yet" in line]) == 2  # said once each


def test_a_name_that_moves_is_followed_and_one_that_stops_resolving_keeps_its_address():
    dns = FakeDns({"ps.example": ["10.2.0.1"], "chief.example": ["10.2.0.3"]})
    restrict = Recorder()
    peers = Peers(["ps.example", "chief.example", "10.2.0.2"], 4444, what="worker:0", say=print,
                  resolve=dns, restrict=restrict, resolve_every=5.0)
    peers.restrict(peers.start())
    dns.table["ps.example"] = ["10.2.0.7"]  # rescheduled at another address
    del dns.table["chief.example"]  # a DNS hiccup
    assert peers.refresh(now=1e9) is True
    assert peers.peers == {ip("10.2.0.7"), ip("10.2.0.2"), ip("10.2.0.3")}
    # The old address's connections are no intrusion; new ones from it are dropped.
    assert restrict.calls[-1][4] == {ip("10.2.0.1"), ip("10.2.0.2"), ip("10.2.0.3")}
    # Nor later: a connection it made while admitted may outlive its move (a dead pod's,
    # until keep-alive gives up), and the next change must not take it for a stranger's.
    dns.table["chief.example"] = ["10.2.0.8"]
    assert peers.refresh(now=2e9) is True
    assert ip("10.2.0.1") in restrict.calls[-1][4] and ip("10.2.0.1") not in restrict.calls[-1][1]


def test_is_name():
    assert is_name("job-ps-0.job") and is_name("localhost")
    assert not is_name("10.0.0.1") and not is_name("fd00::1") and not is_name("[fd00::1]")


@pytest.mark.skipif(not exposure.supported(), reason="socket filters need Linux")
def test_an_unlocked_filter_is_replaced_on_a_real_listening_socket(tmp_path):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        path = tmp_path / "cluster.json"
        write(path, ["127.0.0.1:5"])
        lines = []
        peers = Peers(["127.0.0.1"], port, what="ps:0", say=lines.append, path=path)
        peers.restrict(peers.start())
        write(path, ["127.0.0.1:5", "10.1.2.3:5"])
        assert peers.refresh() is True  # the kernel took the replacement
        assert ip("10.1.2.3") in peers.peers
        # Loopback still gets in.
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass


def _serve(*args):
    return subprocess.run([sys.executable, "-m", "psclient", "serve", "--job", "worker", "--index", "0", *args],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("option", [["--peers-file", "peers.json"], ["--peer-hosts", "a.example"]],
                         ids=["peers-file", "peer-hosts"])
def test_serve_refuses_peers_options_with_allow_any_host(tmp_path, option):
    path = tmp_path / "cluster.json"
    write(path, ["127.0.0.1:5"])
    result = _serve("--cluster", str(path), "--allow-any-host", *option)
    assert result.returncode == 2
    assert f"Invalid value for {option[0]}" in result.stderr and "with --allow-any-host" in result.stderr


@pytest.mark.parametrize("value", ["a.example:2222", "a b", ","], ids=["port", "space", "empty"])
def test_serve_refuses_bad_peer_hosts(tmp_path, value):
    path = tmp_path / "cluster.json"
    write(path, ["127.0.0.1:5"])
    result = _serve("--cluster", str(path), "--peer-hosts", value)
    assert result.returncode == 2
    assert f"Invalid value for --peer-hosts. Received: {value!r}" in result.stderr


def test_allow_any_host_and_restrict_to_peers_contradict(tmp_path):
    path = tmp_path / "cluster.json"
    write(path, ["127.0.0.1:5"])
    result = _serve("--cluster", str(path), "--allow-any-host", "--restrict-to-peers")
    assert result.returncode == 2
    assert "--restrict-to-peers: not allowed with argument --allow-any-host" in result.stderr
